"""The bundled demo model: loads offline on every backend, and shows the behaviour it was trained for.

Thresholds (issue: the demo must show real structure): a head with induction score > 0.8 on
repeated random words, IOI accuracy >= 0.95 with mean logit difference > 5, facts accuracy >= 0.95,
greater-than probability difference > 0.5. Every number is computed here from the model's own
outputs and attention patterns on fresh prompts (seeds the training never used).
"""

import pytest
import torch

import entoscope as es
from entoscope.evaluate import task_scores
from entoscope.models import adapt

from conftest import has_hooked_transformer


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_demo_loads_on_every_backend():
    plain = adapt(es.load_model("demo"))
    s = plain.structure
    assert (s.architecture, s.n_layers, s.n_heads, s.d_model, s.n_ctx) == ("GPT2LMHeadModel", 3, 4, 128, 64)
    toks = torch.tensor([plain.tokenize("When Mary and John went to the store")])
    variants = [es.load_model("demo", compat=True)]
    if has_hooked_transformer():
        variants.append(es.load_model("demo", backend="hooked"))
    for m in variants:
        other = adapt(m).run(toks).logits.log_softmax(-1)
        assert (other - plain.run(toks).logits.log_softmax(-1)).abs().max() < 1e-4


def test_demo_task_thresholds(demo):
    scores = task_scores(demo, n=128, seed=4321)
    assert scores["ioi"]["accuracy"] >= 0.95 and scores["ioi"]["logit_diff"] > 5
    assert scores["facts"]["accuracy"] >= 0.95
    assert scores["greater_than"]["prob_diff"] > 0.5


def test_demo_has_an_induction_head(demo):
    # repeated random WORDS (each one token), period = sequence length: the head-detector's
    # induction target, query q attends to q - period + 1. Two periods, and the SAME head must pass
    # both: a head that looks back a fixed distance scores high for one period only (a positional
    # shortcut this small GPT-2 readily learns, docs/demo_model.md).
    a = adapt(demo)
    per_period = []
    for period in (12, 7):
        prompts = []
        for ex in es.tasks.induction(n=32, seed=4321, length=period):
            seq = a.tokenize("".join(" " + w for w in ex.meta["words"]), prepend_bos=False)
            assert len(seq) == period  # every word is one token
            prompts.append(es.Example(tuple([a.bos_token_id] + seq + seq)))
        table = es.HeadScores(kinds=["induction"], period=period).run(
            demo, es.Dataset("rep", tuple(prompts)), quiet=True).table
        per_period.append(table.set_index(["layer", "head"]).score)
    both = per_period[0].combine(per_period[1], min)
    assert both.max() > 0.8, f"best induction score over both periods {both.max():.3f} (head {both.idxmax()})"


def test_offline_hub_name_is_a_clear_error():
    with pytest.raises(OSError) as err:
        es.load_model("gpt2")
    assert err.value.code == "hub_unreachable" and "--model" in str(err.value)
