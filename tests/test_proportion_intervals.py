"""Shares of prompts carry Wilson intervals (tests/wilson_by_hand.py, written out from Wilson 1927), so a share
at 1.0 has an interval whose low end lies below 1: probing's held-out accuracy (k correct of the n held-out
prompts, counted here from the saved per-prompt predictions), the lens's per-prompt top-1 shares beside the
mean distribution's top token (counted here from the per-prompt table), on the demo model and on SmolLM2."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import entoscope as es
from entoscope.probing.intervals import HeldOut, summarise_probing
from entoscope.stats import Stats

from wilson_by_hand import wilson_by_hand


def _held_out(y: np.ndarray, logits: np.ndarray, folds: int = 2) -> HeldOut:
    R = len(y)
    return HeldOut(fold=np.arange(R) % folds, example=np.arange(R), y=y, values=logits[None, :, None],
                   y_control=None, control_values=None, site_names=["resid_post.1"], n_classes=2)


@pytest.mark.parametrize("wrong", [0, 5])
def test_probing_accuracy_has_wilsons_interval_over_the_held_out_prompts(wrong):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 64)
    logits = np.where(y == 1, 2.0, -2.0)
    logits[:wrong] *= -1  # the first `wrong` prompts misclassified
    row = summarise_probing(_held_out(y, logits), Stats(n_boot=200), seed=0).iloc[0]
    low, high = wilson_by_hand(64 - wrong, 64)
    assert row["test_accuracy_ci_low"] == pytest.approx(low, abs=1e-12)
    assert row["test_accuracy_ci_high"] == pytest.approx(high, abs=1e-12)
    if wrong == 0:  # the bootstrap would say [1, 1]; 64 prompts say no more than this
        assert row["test_accuracy_ci_low"] < 0.95 and row["test_accuracy_ci_high"] == pytest.approx(1.0)


def _check_probing(result) -> None:
    """Each site's interval is Wilson's of (correct held-out predictions, held-out prompts), both counted from
    the per-prompt table."""
    pp = result.per_prompt
    for _, row in result.table.iterrows():
        mine = pp[pp["site"] == row["site"]]
        k, n = int(mine["correct"].sum()), len(mine)
        assert n == int(row["n_held_out"])
        low, high = wilson_by_hand(k, n)
        assert row["test_accuracy_ci_low"] == pytest.approx(low, abs=1e-9)
        assert row["test_accuracy_ci_high"] == pytest.approx(high, abs=1e-9)
        assert row["test_accuracy_ci_low"] < 1.0


def test_a_probe_right_on_every_held_out_prompt_of_the_demo_has_an_interval_below_one():
    from entoscope.data import Dataset

    model = es.load_model("demo")
    base = es.tasks.facts(n=640, seed=0)  # 20 prompts of each of 32 countries: France against Japan
    data = Dataset("facts2", tuple(e for e in base if e.meta["country"] in ("France", "Japan")))
    op = es.Probing(sites={"activation": "resid_post", "over": ["layer"]}, pooling="mean", labels="meta.country",
                    split="kfold", k=4, seed=0)
    result = op.run(model, data, quiet=True)
    assert (result.table["test_accuracy"] == 1.0).any()  # the country is read perfectly somewhere
    _check_probing(result)


def _check_lens_shares(result) -> None:
    t, pp = result.table, result.per_prompt
    for _, row in t.iterrows():
        tops = pp[pp["site"] == row["site"]]["top1_token"]
        n = len(tops)
        k_mean = int((tops == row["top1_token"]).sum())
        counts = tops.value_counts()
        assert row["top1_token_share"] == pytest.approx(k_mean / n)
        assert row["modal_share"] == pytest.approx(counts.iloc[0] / n)
        assert counts[row["modal_token"]] == counts.iloc[0]
        for col, k in (("top1_token_share", k_mean), ("modal_share", counts.iloc[0])):
            low, high = wilson_by_hand(int(k), n)
            assert row[f"{col}_ci_low"] == pytest.approx(low, abs=1e-12)
            assert row[f"{col}_ci_high"] == pytest.approx(high, abs=1e-12)
            if k == n:
                assert row[f"{col}_ci_low"] < 1.0


def test_the_lens_table_gives_each_sites_per_prompt_top1_shares_with_wilson_intervals():
    model = es.load_model("demo")
    r = es.Lens(sites={"activation": "resid_post", "over": ["layer", "position"], "positions": "-2:"}).run(
        model, {"task": "ioi", "n": 16, "seed": 7}, quiet=True)
    _check_lens_shares(r)
    assert (r.table["modal_share"] == 1.0).any()  # '  to' tops every prompt before END: a share at 1.0


@pytest.mark.real
def test_on_smollm2_a_perfect_probe_and_the_lens_shares_have_intervals_below_one(smollm2_folder):
    """SmolLM2 reads IOI's name order perfectly at resid_post.21 (the report's probing section: 1.00 over 64
    held-out prompts); the interval is Wilson's, below 1. The lens's shares at the last layers likewise."""
    model = es.load_model(str(smollm2_folder))
    op = es.Probing(sites={"activation": "resid_post", "over": ["layer"], "layers": [21]}, split="kfold", k=4,
                    seed=0)
    _check_probing(op.run(model, {"task": "ioi", "n": 64, "seed": 11}, quiet=True))
    r = es.Lens(sites={"activation": "resid_post", "over": ["layer"], "layers": [28, 29]}).run(
        model, {"task": "ioi", "n": 8, "seed": 7}, quiet=True)
    _check_lens_shares(r)

