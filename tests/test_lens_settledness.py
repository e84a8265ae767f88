"""A Jacobian lens's settledness is stated where it is read (the lens comparison): the table's split-half change
is ||J_0 - J_1|| / ||(J_0 + J_1) / 2||, J_t the lens fitted on text t alone (two separate fits, here), and the
takeaway says "unsettled" at 0.1 or more, "settled" below, with the texts it was fitted on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.data import tasks
from entoscope.lens import JacobianLens
from entoscope.lens.compare import SETTLED, compare_lenses

FIT = {"skip_first": 4, "max_length": 32, "quiet": True}


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_the_comparison_states_the_split_half_change_of_two_separate_fits(demo, tmp_path):
    corpus = tasks.corpus(n=2, seed=3)
    both = JacobianLens.fit(demo, corpus, **FIT)
    alone = [JacobianLens.fit(demo, [text], **FIT) for text in (corpus[0].prompt, corpus[1].prompt)]
    both.save(tmp_path / "j")
    r = compare_lenses(demo, {"task": "ioi", "n": 8, "seed": 7}, jacobian=str(tmp_path / "j"))
    jac = r.table[r.table["lens"] == "jacobian"].set_index("layer")
    assert set(jac["fit_texts"]) == {2}
    for layer in both.source_layers:
        a, b = (lens.jacobians[layer].double() for lens in alone)
        brute = float(torch.linalg.norm(a - b) / torch.linalg.norm((a + b) / 2))
        assert jac.loc[layer, "split_half_change"] == pytest.approx(brute, rel=1e-4)
    last = demo.cfg.n_layers - 1 if hasattr(demo, "cfg") else max(jac.index)
    assert np.isnan(jac.loc[last, "split_half_change"])  # the last layer: the identity, nothing fitted
    worst = float(jac["split_half_change"].max())
    text = str(r.takeaway)
    assert "fitted on 2 texts" in text and f"{worst:.2f}" in text
    assert ("unsettled" in text) == (worst >= SETTLED) and worst >= SETTLED  # two texts never settle a lens


def test_a_lens_without_a_record_says_its_settledness_is_unknown(demo, tmp_path):
    lens = JacobianLens.fit(demo, tasks.corpus(n=2, seed=3), **FIT)
    lens.settledness = {}  # as a TransformerLens file: no split-half record
    lens.save(tmp_path / "j")
    r = compare_lenses(demo, {"task": "ioi", "n": 8, "seed": 7}, jacobian=str(tmp_path / "j"))
    assert r.table["split_half_change"].isna().all()
    assert "records no split-half change" in str(r.takeaway)
