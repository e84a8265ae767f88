"""Data: files load into examples, tokenising refuses what cannot be scored, batches cover each example once."""

import json

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example, load_data, make_batches, tokenize_data
from entoscope.data.tokenized import length_batches, pad
from entoscope.errors import DataError
from entoscope.models import adapt


@pytest.fixture(scope="module")
def demo():
    return adapt(es.load_model("demo"))


def test_jsonl_and_csv_records(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "The capital of France is", "answer": " Paris", "wrong_answer": " Madrid", "label": 1, "src": "a"},
        {"prompt": "The capital of Spain is", "answers": [" Madrid"], "counterfactual": "The capital of Italy is"},
    ]))
    d = load_data({"path": str(tmp_path / "d.jsonl")})
    assert d[0].answers == (" Paris",) and d[0].wrong_answers == (" Madrid",) and d[0].meta == {"src": "a"}
    assert d[1].counterfactual == "The capital of Italy is" and d[1].label is None
    (tmp_path / "d.csv").write_text('prompt,answer,label\n"The capital of France is", Paris,3\n')
    c = load_data({"path": str(tmp_path / "d.csv")})
    assert c[0].answers == (" Paris",) and c[0].label == 3
    with pytest.raises(DataError) as err:
        load_data({"path": str(tmp_path / "missing.jsonl")})
    assert err.value.code == "data_file_missing"


def test_inline_prompts_and_tasks():
    assert [e.prompt for e in load_data(["a b", "c"])] == ["a b", "c"]
    d = load_data({"task": "ioi", "n": 5, "seed": 3})
    assert len(d) == 5 and d.params["task"] == "ioi" and d.has_counterfactuals and d.has_answers


def test_pairs_of_different_lengths_are_refused_naming_the_pair(demo):
    data = Dataset("x", (Example("When Mary and John went", counterfactual="When Mary went"),))
    with pytest.raises(DataError) as err:
        tokenize_data(demo, data, pairs=True)
    n_p, n_c = len(demo.tokenize("When Mary and John went")), len(demo.tokenize("When Mary went"))
    assert err.value.code == "lengths_differ" and "pair 0" in str(err.value)
    assert f"{n_p} tokens" in str(err.value) and f"counterfactual {n_c}" in str(err.value)


def test_multi_token_answers_are_read_by_their_first_token_unless_single_is_asked(demo):
    data = Dataset("x", (Example("The capital of France is", answers=(" Paris is nice",)),))
    with pytest.raises(DataError) as err:
        tokenize_data(demo, data, answers=True, answer_scoring="single")
    assert err.value.code == "multi_token_answer" and "example 0" in str(err.value)
    td = tokenize_data(demo, data, answers=True)
    assert td.answers == [[demo.tokenize(" Paris is nice", prepend_bos=False)[0]]]


def test_batches_cover_each_example_once_and_group_by_length():
    lengths = [5, 9, 5, 7, 9, 6, 5]
    batches = length_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(7))
    # sorted by length: every batch's longest prompt is no longer than the next batch's shortest
    spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches]
    assert all(hi <= nxt_lo for (_, hi), (nxt_lo, _) in zip(spans, spans[1:]))
    assert spans[0] == (5, 5)
    tokens, lens = pad([[1, 2, 3], [4]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and lens.tolist() == [3, 1]


def test_make_batches_keeps_answers_aligned(demo):
    data = es.tasks.greater_than(n=6, seed=0)
    td = tokenize_data(demo, data, answers=True, pairs=True)
    for b in make_batches(td, 4, 0):
        for row, ex in enumerate(b.index):
            n = len(td.answers[ex])
            assert b.answers[row, :n].tolist() == td.answers[ex] and (b.answers[row, n:] == -1).all()
            assert torch.equal(b.tokens[row, : b.lengths[row]], torch.tensor(td.prompts[ex]))
