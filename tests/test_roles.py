"""Positions by role: the tasks' roles point at the right tokens, sites resolve them per prompt, and an
operation on role positions equals the same operation run prompt by prompt at each one's own index."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.data.examples import Dataset, Example
from entoscope.data.tokenized import tokenize_data
from entoscope.errors import DataError, SiteError
from entoscope.models import adapt


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _token_at(a, ids, roles, name):
    return a.token_strs(ids)[int(roles.positions[0, roles.index(name)])]


def test_task_roles_point_at_their_tokens(demo):
    a = adapt(demo)
    for e in es.tasks.ioi(n=6, seed=2):
        td = tokenize_data(a, Dataset("one", (e,)), pairs=True)
        assert _token_at(a, td.prompts[0], td.roles, "IO") == " " + e.meta["io"]
        assert _token_at(a, td.prompts[0], td.roles, "S1") == " " + e.meta["s"]
        assert _token_at(a, td.prompts[0], td.roles, "S2") == " " + e.meta["s"]
        s1, s2 = (int(td.roles.positions[0, td.roles.index(n)]) for n in ("S1", "S2"))
        assert s1 < s2 and _token_at(a, td.prompts[0], td.roles, "END") == a.token_strs(td.prompts[0])[-1]
        x, y, z = e.meta["counterfactual_names"]  # ABC: the names in the same slots
        assert _token_at(a, td.counterfactuals[0], td.cf_roles, "S2") == " " + z
    for e in es.tasks.greater_than(n=6, seed=3):
        td = tokenize_data(a, Dataset("one", (e,)), pairs=True)
        assert _token_at(a, td.prompts[0], td.roles, "YY") == f"{e.meta['yy']:02d}"
        assert _token_at(a, td.prompts[0], td.roles, "XX") == f" {e.meta['century']}"
        assert _token_at(a, td.counterfactuals[0], td.cf_roles, "YY") == "01"
    for e in es.tasks.induction(n=4, seed=1):
        td = tokenize_data(a, Dataset("one", (e,)))
        words, k = e.meta["words"], e.meta["k"]
        assert _token_at(a, td.prompts[0], td.roles, "A1") == " " + words[k - 1]
        assert _token_at(a, td.prompts[0], td.roles, "B1") == " " + words[k] == e.answers[0]
    for e in es.tasks.facts(n=4, seed=1):
        td = tokenize_data(a, Dataset("one", (e,)))
        assert _token_at(a, td.prompts[0], td.roles, "SUBJ") == " " + e.meta["country"]


def test_markers_and_role_fields_of_user_data(demo, tmp_path):
    e = Example("When [[IO:Mary]] and [[S1:John]] went to the store, [[S2:John]] gave a drink to")
    assert e.prompt == "When Mary and John went to the store, John gave a drink to"
    assert e.roles == {"IO": [5, 9], "S1": [14, 18], "S2": [38, 42]}
    assert e.prompt[5:9] == "Mary" and e.prompt[38:42] == "John"
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "The capital of France is", "roles": {"SUBJ": [15, 21]}})
                                      + "\n" + json.dumps({"prompt": [1, 2, 3, 4], "roles": {"X": -2}}) + "\n")
    data = es.load_data({"path": str(tmp_path / "d.jsonl")})
    a = adapt(demo)
    td = tokenize_data(a, data)
    assert a.token_strs(td.prompts[0])[int(td.roles.positions[0, td.roles.index("SUBJ")])] == " France"
    assert int(td.roles.positions[1, td.roles.index("X")]) == 2 and int(td.roles.positions[0, td.roles.index("X")]) == -1
    for bad in ({"roles": {"S2": "here"}}, {"roles": {"END": 3}}, {"roles": [1, 2]}):
        with pytest.raises(DataError) as err:
            Example("a b c", meta=bad)
        assert err.value.code == "role_invalid"


def test_role_positions_resolve_per_prompt_in_the_lens(demo):
    data = es.tasks.ioi(n=8, seed=4)
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions=["S1", "S2+1", "END"]))
    result = lens.run(demo, data, quiet=True)
    assert list(result.table.position.unique()) == ["S1", "S2+1", "END"]
    a = adapt(demo)
    td = tokenize_data(a, data)
    pp = result.per_prompt
    for e in range(len(data)):
        rows = pp[(pp.example == e) & (pp.layer == 0)].set_index("position")
        s1 = int(td.roles.positions[e, td.roles.index("S1")])
        s2 = int(td.roles.positions[e, td.roles.index("S2")])
        assert rows.loc["S1", "token_position"] == s1 and rows.loc["S2+1", "token_position"] == s2 + 1
        assert rows.loc["END", "token_position"] == len(td.prompts[e]) - 1


def test_patching_at_a_role_equals_each_prompt_patched_at_its_own_index(demo):
    data = es.tasks.greater_than(n=6, seed=7)
    a = adapt(demo)
    td = tokenize_data(a, data, pairs=True)
    op = es.Patching(sites=es.Sites(activation="mlp_out", over=["layer", "position"], positions=["YY"]),
                     metric="prob_diff", stats={"n_boot": 0})
    together = op.run(demo, data, quiet=True).per_prompt
    for e in range(len(data)):
        p = int(td.cf_roles.positions[e, td.cf_roles.index("YY")])  # denoising: the corrupt run is patched
        alone = es.Patching(sites=es.Sites(activation="mlp_out", over=["layer", "position"], positions=[p]),
                            metric="prob_diff", stats={"n_boot": 0}).run(demo, data[e:e + 1], quiet=True).per_prompt
        mine = together[together.example == e]
        np.testing.assert_allclose(mine.patched_metric.to_numpy(), alone.patched_metric.to_numpy(), atol=1e-6)
        assert (mine.token_position == p).all()


def test_a_numeric_position_that_mixes_roles_is_warned_about(demo):
    data = es.tasks.greater_than(n=24, seed=0)
    templates = {e.meta["template"] for e in data}
    assert len(templates) > 1
    op = es.Patching(sites=es.Sites(activation="mlp_out", over=["layer", "position"], positions=[-5]), metric="prob_diff")
    plan = op.plan(demo, data)
    assert any("position_roles_differ" in n and "YY" in n for n in plan.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # role positions: no warning
        es.Patching(sites=es.Sites(activation="mlp_out", over=["layer", "position"], positions=["YY", "END"]),
                    metric="prob_diff").plan(demo, data)


def test_unknown_or_missing_roles_are_refused(demo):
    with pytest.raises(SiteError) as err:
        es.Lens(sites=es.Sites(activation="resid_post", over=["position"], positions=["S3"])).plan(demo, es.tasks.ioi(n=2))
    assert err.value.code == "role_unknown" and "S2" in err.value.remedy
    mixed = Dataset("mixed", (Example("[[A:one]] two three"), Example("one two three")))
    with pytest.raises(SiteError) as err:
        es.Lens(sites=es.Sites(activation="resid_post", over=["position"], positions=["A"])).plan(demo, mixed)
    assert err.value.code == "role_missing"
    with pytest.raises(SiteError) as err:
        es.Lens(sites=es.Sites(activation="resid_post", over=["position"], positions=["END+1"])).plan(demo, mixed)
    assert err.value.code == "site_out_of_range"
    assert torch.is_tensor(tokenize_data(adapt(demo), mixed).roles.positions)


@pytest.mark.parametrize("prompt, says", [
    ("When [[IO:]] and John went", "marks no text"),
    ("When [[IO: ]] and John went", "marks no text"),
    ("When [[IO:Mary [[S1:John]] went]] to", "overlaps another marker"),
    ("When [[IO:Mary and John went", "unclosed role marker"),
    ("When [[IO:Mary]] and [[IO:John]] went", "marked twice"),
])
def test_markers_that_mark_nothing_overlap_or_repeat_are_refused_with_the_examples_index(tmp_path, prompt, says):
    """Each loader names the example: inline prompts by index, files by line, a manifest's records by index."""
    good = "When [[IO:Mary]] and [[S1:John]] went"
    with pytest.raises(DataError) as err:
        es.load_data([good, good, prompt])
    assert err.value.code == "role_invalid" and err.value.message.startswith("prompt 2:") and says in err.value.message
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in (good, prompt)) + "\n")
    with pytest.raises(DataError) as err:
        es.load_data({"path": str(tmp_path / "d.jsonl")})
    assert err.value.code == "role_invalid" and f"d.jsonl:2" in err.value.message and says in err.value.message
    records = [Example(good).to_record(), {"prompt": prompt}]
    with pytest.raises(DataError) as err:
        Dataset.from_records("m", records)
    assert err.value.code == "role_invalid" and err.value.message.startswith("example 1:")


def test_role_spans_that_overlap_or_end_in_one_token_are_refused(demo):
    text = "When Mary and John went to the store"
    for roles, says in (({"A": [5, 9], "B": [7, 12]}, "overlap"), ({"A": [5, 9], "B": [0, 7]}, "overlap")):
        with pytest.raises(DataError) as err:
            Example(text, meta={"roles": roles})
        assert err.value.code == "role_invalid" and says in err.value.message
    with pytest.raises(DataError) as err:  # a marker and a roles entry for one name
        Example("When [[A:Mary]] went", meta={"roles": {"A": [0, 4]}})
    assert err.value.code == "role_invalid" and "given twice" in err.value.message
    # " Mary" is one token of the demo tokenizer: marking "Ma" and "ry" points both roles at it
    split = Dataset("d", (Example(text), Example("When [[A:Ma]][[B:ry]] and John went to the store")))
    assert adapt(demo).token_strs(adapt(demo).tokenize(" Mary", prepend_bos=False)) == [" Mary"]
    with pytest.raises(DataError) as err:
        tokenize_data(adapt(demo), split)
    assert err.value.code == "role_invalid" and err.value.message.startswith("prompt 1:") and "token" in err.value.message
    apart = Dataset("d", (Example("When [[A:Mary]] and [[B:John]] went"),))  # whole words: accepted
    roles = tokenize_data(adapt(demo), apart).roles
    assert roles.positions[0, roles.index("A")] < roles.positions[0, roles.index("B")]
