"""Your own data (docs/data.md): records in memory (a list of dicts passed as data keeps its counterfactual and
answers), JSONL / CSV files, templates with role slots; checked against examples written out by hand, character
spans read back from the text, token positions counted by the tokenizer here; and the page's examples, run."""

import linecache
import re
from pathlib import Path

import pytest

import entoscope as es
from entoscope.data.tokenized import tokenize_data
from entoscope.errors import EntoscopeError
from entoscope.models.adapter import adapt
from entoscope.models.tiny import tiny_model, tiny_tokenizer

PAGE = Path(__file__).resolve().parent.parent / "docs" / "data.md"
ISSUE_RECORD = {"prompt": "When Mary and John went to the store, John gave a drink to",  # the issue's, in the demo's names
                "counterfactual": "When Mary and John went to the store, Paul gave a drink to",
                "answer": " Mary", "wrong_answer": " John"}


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


# ------------------------------------------------------------------ records
def test_a_list_of_records_given_as_data_keeps_the_counterfactual_and_answers():
    data = es.load_data([ISSUE_RECORD, "a plain prompt"])
    by_hand = es.Example(ISSUE_RECORD["prompt"], counterfactual=ISSUE_RECORD["counterfactual"],
                         answers=(" Mary",), wrong_answers=(" John",))
    assert data[0] == by_hand and data[1] == es.Example("a plain prompt")
    assert data.name == "records"


def test_the_issues_run_works_and_equals_the_same_data_as_examples(demo):
    """op.run(model, [{"prompt", "counterfactual", "answer", "wrong_answer"}]) was refused with prompt_invalid."""
    op = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"], positions=[-1]))
    records = [ISSUE_RECORD, {**ISSUE_RECORD, "counterfactual": ISSUE_RECORD["prompt"].replace("Mary and John", "Paul and "
                                                                                                "Mary")}]
    ours = op.run(demo, records, quiet=True)
    by_hand = es.Dataset("by_hand", tuple(es.Example(r["prompt"], counterfactual=r["counterfactual"],
                                                     answers=(r["answer"],), wrong_answers=(r["wrong_answer"],))
                                          for r in records))
    theirs = op.run(demo, by_hand, quiet=True)
    assert list(ours.table["value"]) == list(theirs.table["value"])
    assert [r["counterfactual"] for r in ours.manifest["data"]["records"]] == [r["counterfactual"] for r in records]


def test_records_without_a_prompt_and_records_as_prompts_are_refused_naming_from_records():
    with pytest.raises(EntoscopeError) as err:
        es.load_data([{"text": "x", "counterfactual": "y"}])
    assert err.value.code == "record_invalid" and "es.Dataset.from_records" in err.value.remedy
    assert "prompt 0" in str(err.value)
    with pytest.raises(EntoscopeError) as err:
        es.Example(ISSUE_RECORD)  # a record where one prompt is expected
    assert err.value.code == "prompt_invalid" and "es.Dataset.from_records" in err.value.remedy
    with pytest.raises(EntoscopeError) as err:
        es.Dataset.from_records([ISSUE_RECORD, {**ISSUE_RECORD, "answers": [" Mary"]}])
    assert err.value.code == "record_invalid" and "record 1" in str(err.value)


def test_from_records_spellings_and_round_trip():
    records = [{**ISSUE_RECORD, "roles": {"S2": [38, 42]}, "source": "mine", "label": 2}]
    a = es.Dataset.from_records(records)
    b = es.Dataset.from_records("mine", records)
    assert a.examples == b.examples and (a.name, b.name) == ("records", "mine")
    e = a[0]
    assert e.answers == (" Mary",) and e.wrong_answers == (" John",) and e.label == 2
    assert e.meta["source"] == "mine" and e.prompt[slice(*e.roles["S2"])] == "John"
    again = es.Dataset.from_records("again", a.to_records())
    assert again.examples == a.examples


# ------------------------------------------------------------------ files
def test_csv_cells_hold_json_lists_roles_and_markers(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answers,roles,label\n'
                    '"When [[IO:Mary]] and John went","["" a"", "" b""]",,\n'
                    'When Mary and John went,,"{""S"": [14, 18]}",3\n')
    data = es.load_data({"path": str(path)})
    assert data[0].prompt == "When Mary and John went" and data[0].roles == {"IO": [5, 9]}
    assert data[0].answers == (" a", " b") and data[0].label is None
    assert data[1].roles == {"S": [14, 18]} and data[1].prompt[14:18] == "John" and data[1].label == 3
    bad = tmp_path / "bad.csv"
    bad.write_text('prompt,roles\nx,"{not json"\n')
    with pytest.raises(EntoscopeError) as err:
        es.load_data({"path": str(bad)})
    assert err.value.code == "data_file_invalid" and "bad.csv:1" in str(err.value)


# ------------------------------------------------------------------ templates
TEMPLATE = "When {IO} and {S} went to the store, {S} gave a drink to"
CF = "When {IO} and {S} went to the store, {C} gave a drink to"


def test_a_template_gives_prompts_counterfactuals_answers_and_roles():
    fills = [{"IO": "Mary", "S": "John", "C": "Paul", "label": 1}, {"IO": "Anna", "S": "Tom", "C": "Mark"}]
    data = es.Dataset.from_template(TEMPLATE, fills, counterfactual=CF, answers=" {IO}", wrong_answers=[" {S}", " {C}"])
    for e, f in zip(data, fills):
        assert e.prompt == f"When {f['IO']} and {f['S']} went to the store, {f['S']} gave a drink to"
        assert e.counterfactual == f"When {f['IO']} and {f['S']} went to the store, {f['C']} gave a drink to"
        assert e.answers == (" " + f["IO"],) and e.wrong_answers == (" " + f["S"], " " + f["C"])
        spans = {k: e.prompt[a:b] for k, (a, b) in e.roles.items()}
        assert spans == {"IO": f["IO"], "S1": f["S"], "S2": f["S"]}
        assert e.prompt.index(f["S"]) == e.roles["S1"][0] and e.prompt.rindex(f["S"]) == e.roles["S2"][0]
        cf_spans = {k: e.counterfactual[a:b] for k, (a, b) in e.cf_roles.items()}
        assert cf_spans == {"IO": f["IO"], "S1": f["S"], "S2": f["C"]}  # the k-th slot plays the k-th role
        assert e.meta["C"] == f["C"]
    assert (data[0].label, data[1].label) == (1, None)


def test_template_roles_are_the_tokens_the_tokenizer_puts_there():
    model = adapt(tiny_model("gpt2"))
    data = es.Dataset.from_template(TEMPLATE, [{"IO": "Mary", "S": "John"}, {"IO": "John", "S": "Mary"}])
    td = tokenize_data(model, data)
    tok = tiny_tokenizer()
    for i, e in enumerate(data):
        for role in ("IO", "S1", "S2"):
            end = e.roles[role][1]
            by_hand = len(tok(e.prompt[:end], add_special_tokens=False)["input_ids"])  # BOS first: its last token
            assert int(td.roles.positions[i, td.roles.index(role)]) == by_hand


def test_a_counterfactual_with_other_slots_names_its_own_roles():
    data = es.Dataset.from_template("{A} met {B}", [{"A": "Mary", "B": "John", "C": "Paul"}],
                                    counterfactual="{C} met {C} and {A}")
    assert data[0].counterfactual == "Paul met Paul and Mary"
    assert data[0].cf_roles == {"C1": [0, 4], "C2": [9, 13], "A": [18, 22]}


@pytest.mark.parametrize("template,fills,code,says", [
    ("{A} met {B}", [{"A": "Mary"}], "template_fill_missing", "fill 0 has no value for {B}"),
    ("{S} met {S} and {S1}", [{"S": "a", "S1": "b"}], "template_invalid", "role S1 twice"),
    ("{0} met", [{"0": "a"}], "template_invalid", "not a plain name"),
    ("{A:>3} met", [{"A": "a"}], "template_invalid", "not a plain name"),
    ("{A} met {", [{"A": "a"}], "template_invalid", "cannot be read"),
    ("[[A:x]] met {B}", [{"B": "a"}], "template_invalid", "role marker"),
    ("{END} met", [{"END": "a"}], "template_invalid", "END"),
    ("{A} met", [{"A": None}], "template_invalid", "neither text nor an integer"),
    ("{A} met", [{"A": " "}], "role_invalid", "fill 0"),
    ("{A} met", {"A": "x"}, "template_invalid", "list of dicts"),
])
def test_bad_templates_and_fills_are_refused(template, fills, code, says):
    with pytest.raises(EntoscopeError) as err:
        es.Dataset.from_template(template, fills)
    assert err.value.code == code and says in str(err.value)


# ------------------------------------------------------------------ the page
def test_the_data_pages_examples_run(monkeypatch, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)  # the page writes pairs.jsonl and pairs.csv where it runs
    namespace: dict = {}
    for i, block in enumerate(blocks):
        name = f"<{PAGE.name} block {i + 1}>"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)
        exec(compile(block, name, "exec"), namespace)
    assert namespace["data"].has_counterfactuals and len(namespace["ioi"]) == 2
