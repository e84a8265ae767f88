"""The built-in tasks (entoscope.data.tasks) and the bundled demo tokenizer/model they are made for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from entoscope.data import tasks
from entoscope.data.examples import Dataset
from entoscope.data.tasks import vocab
from entoscope.data.tasks.greater_than import year_sets

DEMO = Path(tasks.__file__).resolve().parents[2] / "demo"
GENERATORS = ["ioi", "induction", "facts", "greater_than"]


@pytest.fixture(scope="module")
def demo_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(DEMO)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


class FakeTokenizer:
    """One token per word of `known` (written after a space); two tokens for anything else."""

    name_or_path = "fake"

    def __init__(self, known: set[str]):
        self.known = known

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] if text.strip() in self.known else [1, 2]


# ------------------------------------------------------------------------------------- registry
def test_registry_names_and_get():
    assert set(GENERATORS) <= set(tasks.TASKS)
    data = tasks.get("ioi", n=6, seed=3)
    assert isinstance(data, Dataset) and data.name == "ioi" and len(data) == 6
    assert data.params["n"] == 6 and data.params["seed"] == 3
    assert tasks.get("Greater-Than", n=2).name == "greater_than"
    with pytest.raises(ValueError, match="unknown task 'nope'.*ioi"):
        tasks.get("nope")


@pytest.mark.parametrize("name", GENERATORS)
def test_deterministic_by_seed(name):
    a = tasks.get(name, n=20, seed=7).to_records()
    assert a == tasks.get(name, n=20, seed=7).to_records()
    assert a != tasks.get(name, n=20, seed=8).to_records()
    json.dumps(a)  # records are JSON-serialisable (the manifest keeps them)


@pytest.mark.parametrize("name", GENERATORS)
def test_dataset_flags(name):
    data = tasks.get(name, n=10)
    assert len(data) == 10 and data.has_counterfactuals and data.has_answers
    assert all(e.wrong_answers for e in data)
    assert all(isinstance(e.prompt, str) and isinstance(e.counterfactual, str) for e in data)
    assert len(tasks.get(name, n=0)) == 0


# ------------------------------------------------------------------- under the demo tokenizer
def test_demo_tokenizer_special_tokens(demo_tokenizer):
    assert demo_tokenizer.bos_token_id == demo_tokenizer.eos_token_id == demo_tokenizer.pad_token_id == 0
    assert demo_tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert demo_tokenizer.decode(ids(demo_tokenizer, "When Mary and John")) == "When Mary and John"


def test_demo_tokenizer_word_lists_are_single_tokens(demo_tokenizer):
    all_words = (vocab.NAMES + vocab.PLACES + vocab.OBJECTS + vocab.GT_NOUNS + vocab.INDUCTION_WORDS
                 + tuple(w for pair in vocab.COUNTRIES for w in pair) + vocab.TWO_DIGITS)
    not_single = [w for w in all_words if len(ids(demo_tokenizer, " " + w)) != 1]
    assert not_single == []
    not_single = [d for d in vocab.TWO_DIGITS if len(ids(demo_tokenizer, d)) != 1]
    assert not_single == []


def test_demo_tokenizer_splits_years_in_two(demo_tokenizer):
    tokens = demo_tokenizer.convert_ids_to_tokens(ids(demo_tokenizer, " 1732 to the year 17"))
    assert tokens == ["Ġ17", "32", "Ġto", "Ġthe", "Ġyear", "Ġ17"]
    assert demo_tokenizer.convert_ids_to_tokens(ids(demo_tokenizer, " 1101")) == ["Ġ11", "01"]


@pytest.mark.parametrize("name", GENERATORS)
def test_counterfactual_same_length_and_single_token_answers(name, demo_tokenizer):
    for e in tasks.get(name, n=64, seed=1):
        assert len(ids(demo_tokenizer, e.prompt)) == len(ids(demo_tokenizer, e.counterfactual)), e
        for answer in e.answers + e.wrong_answers:
            assert len(ids(demo_tokenizer, answer)) == 1, answer


def test_ioi_counterfactual_swap_same_length(demo_tokenizer):
    for e in tasks.ioi(n=32, counterfactual="swap"):
        assert len(ids(demo_tokenizer, e.prompt)) == len(ids(demo_tokenizer, e.counterfactual))


# ------------------------------------------------------------------------------------------ IOI
def test_ioi_abba_baba_balance_and_labels():
    data = tasks.ioi(n=64, seed=5)
    assert sorted(e.label for e in data) == [0] * 32 + [1] * 32
    odd = tasks.ioi(n=7)
    assert sum(e.label == 0 for e in odd) in (3, 4)
    assert len({e.meta["template"] for e in data}) >= 4
    for e in data:
        io, s = e.meta["io"], e.meta["s"]
        assert e.answers == (" " + io,) and e.wrong_answers == (" " + s,)
        names = [w for w in words(e.prompt) if w in vocab.NAMES]
        # the two names, then the subject again
        expected = [io, s, s] if e.meta["order"] == "ABBA" else [s, io, s]
        assert names == expected
        assert e.label == (0 if e.meta["order"] == "ABBA" else 1)
        assert e.prompt.endswith(" to")


def test_ioi_hand_checked_template():
    e = next(e for e in tasks.ioi(n=200) if e.meta["template"] == 0 and e.meta["order"] == "ABBA")
    io, s, place, obj = e.meta["io"], e.meta["s"], e.meta["place"], e.meta["object"]
    assert e.prompt == f"When {io} and {s} went to the {place}, {s} gave a {obj} to"


def test_ioi_abc_counterfactual_uses_three_other_names():
    for e in tasks.ioi(n=64, counterfactual="abc"):
        cf_names = [w for w in words(e.counterfactual) if w in vocab.NAMES]
        assert len(cf_names) == 3 and len(set(cf_names)) == 3
        assert not set(cf_names) & {e.meta["io"], e.meta["s"]}
        # everything but the names is unchanged
        strip = lambda text: [w for w in words(text) if w not in vocab.NAMES]  # noqa: E731
        assert strip(e.counterfactual) == strip(e.prompt)


def test_ioi_swap_counterfactual_flips_the_answer():
    for e in tasks.ioi(n=32, counterfactual="swap"):
        io, s = e.meta["io"], e.meta["s"]
        swapped = [{io: s, s: io}.get(w, w) for w in words(e.prompt)]
        assert words(e.counterfactual) == swapped
    assert all(e.counterfactual is None for e in tasks.ioi(n=4, counterfactual=None))
    with pytest.raises(ValueError, match="counterfactual"):
        tasks.ioi(n=2, counterfactual="bogus")


def test_ioi_keeps_only_single_token_names_of_a_tokenizer():
    known = {"Mary", "John", "Tom", "Amy", "Lisa"} | set(vocab.PLACES) | set(vocab.OBJECTS)
    data = tasks.ioi(n=40, tokenizer=FakeTokenizer(known))
    used = {e.meta["io"] for e in data} | {e.meta["s"] for e in data}
    assert used <= {"Mary", "John", "Tom", "Amy", "Lisa"}
    assert data.params["tokenizer"] == "fake"
    with pytest.raises(ValueError, match=r"'ioi'.*only 4 of 40 names"):
        tasks.ioi(n=4, tokenizer=FakeTokenizer(known - {"Lisa"}))
    # "swap" needs two names only
    assert len(tasks.ioi(n=4, tokenizer=FakeTokenizer(known - {"Lisa"}), counterfactual="swap")) == 4


# ------------------------------------------------------------------------------------ induction
def test_induction_structure(demo_tokenizer):
    for e in tasks.induction(n=64, seed=2, length=10):
        seq, k = e.meta["words"], e.meta["k"]
        assert e.meta["period"] == 10 and 2 <= k <= 9 and len(set(seq)) == 10
        assert e.prompt.split() == seq + seq[:k]
        assert e.answers == (" " + seq[k],)
        wrong = e.wrong_answers[0].strip()
        assert wrong in seq and wrong != seq[k]
        cf = e.counterfactual.split()
        assert cf[10:] == seq[:k] and not set(cf[:10]) & set(seq)
        assert len(ids(demo_tokenizer, e.prompt)) == 10 + k


def test_induction_rejects_short_length_and_small_vocab():
    with pytest.raises(ValueError, match="length"):
        tasks.induction(n=1, length=2)
    few = FakeTokenizer(set(vocab.INDUCTION_WORDS[:15]))
    with pytest.raises(ValueError, match=r"'induction'.*only 15 of"):
        tasks.induction(n=1, tokenizer=few, length=10)


def test_repeated_tokens():
    data = tasks.repeated_tokens(n=8, seed=1, vocab_size=50, length=12, bos_token_id=0)
    for e in data:
        p = e.prompt
        assert len(p) == 25 and p[0] == 0 and p[1:13] == p[13:]
        assert len(set(p[1:13])) == 12 and 0 not in p[1:] and max(p) < 50
        assert e.meta["period"] == 12 and e.meta["offset"] == 1
    no_bos = tasks.repeated_tokens(n=2, vocab_size=50, length=5, bos_token_id=None)
    assert all(len(e.prompt) == 10 and e.prompt[:5] == e.prompt[5:] for e in no_bos)
    config = json.loads((DEMO / "config.json").read_text())
    assert max(max(e.prompt) for e in tasks.repeated_tokens(n=50, length=30)) < config["vocab_size"]


# ---------------------------------------------------------------------------------------- facts
def test_facts_hand_checked_pairs():
    known = {"France": " Paris", "Japan": " Tokyo", "Kenya": " Nairobi", "Peru": " Lima"}
    data = tasks.facts(n=128, seed=0)
    seen = set()
    for e in data:
        country, other = e.meta["country"], e.meta["counterfactual_country"]
        assert country != other and country in e.prompt and e.counterfactual == e.prompt.replace(country, other)
        assert vocab.COUNTRIES[e.label][0] == country
        if country in known:
            assert e.answers == (known[country],)
            seen.add(country)
        if other in known:
            assert e.wrong_answers == (known[other],)
    assert seen == set(known)  # 128 prompts cycle through all 32 countries
    assert {e.label for e in tasks.facts(n=len(vocab.COUNTRIES))} == set(range(len(vocab.COUNTRIES)))


def test_facts_filters_pairs():
    tok = FakeTokenizer({"France", "Paris", "Japan", "Tokyo", "Italy"})  # Rome is not one token
    data = tasks.facts(n=10, tokenizer=tok)
    assert {e.meta["country"] for e in data} == {"France", "Japan"}
    with pytest.raises(ValueError, match=r"'facts'.*only 1 of"):
        tasks.facts(n=1, tokenizer=FakeTokenizer({"France", "Paris"}))


# ---------------------------------------------------------------------------------- greater-than
def test_greater_than_year_sets_hand_checked():
    answers, wrong = year_sets(32)
    assert answers[0] == "33" and answers[-1] == "99" and len(answers) == 67
    assert wrong[0] == "00" and wrong[-1] == "32" and len(wrong) == 33
    assert year_sets(97) == (("98", "99"), tuple(f"{i:02d}" for i in range(98)))
    assert year_sets(2)[1] == ("00", "01", "02")


def test_greater_than_examples():
    all_two_digits = {f"{a}{b}" for a in "0123456789" for b in "0123456789"}
    for e in tasks.greater_than(n=64, seed=4):
        yy, century = e.label, e.meta["century"]
        assert 2 <= yy <= 98
        assert f" {century}{yy:02d} " in e.prompt and e.prompt.endswith(f" year {century}")
        assert e.counterfactual == e.prompt.replace(f" {century}{yy:02d} ", f" {century}01 ")
        assert all(int(a) > yy for a in e.answers) and all(int(w) <= yy for w in e.wrong_answers)
        assert set(e.answers) | set(e.wrong_answers) == all_two_digits
        assert len(e.answers) + len(e.wrong_answers) == 100
        assert e.meta["start_year"] == 100 * century + yy


def test_greater_than_demo_tokens(demo_tokenizer):
    e = tasks.greater_than(n=1, seed=0)[0]
    tokens = demo_tokenizer.convert_ids_to_tokens(ids(demo_tokenizer, e.prompt))
    century, yy = e.meta["century"], e.label
    assert tokens[-1] == f"Ġ{century}"
    assert f"Ġ{century}" in tokens and f"{yy:02d}" in tokens


def test_greater_than_refuses_split_digits():
    tok = FakeTokenizer(set(vocab.GT_NOUNS))  # no two-digit number is one token
    with pytest.raises(ValueError, match="'greater_than'.*two-digit"):
        tasks.greater_than(n=1, tokenizer=tok)


# ------------------------------------------------------------------------ the shipped demo model
def test_demo_model_solves_ioi_and_facts(demo_tokenizer):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(DEMO).eval()
    for data in (tasks.ioi(n=32, seed=11), tasks.facts(n=32, seed=11)):
        correct = 0
        for e in data:
            tokens = torch.tensor([[0] + ids(demo_tokenizer, e.prompt)])
            with torch.no_grad():
                logits = model(tokens).logits[0, -1]
            a, w = ids(demo_tokenizer, e.answers[0]), ids(demo_tokenizer, e.wrong_answers[0])
            correct += int(logits[a[0]] > logits[w[0]])
        assert correct >= 30, (data.name, correct)
