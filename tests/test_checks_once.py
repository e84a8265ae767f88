"""The one-time checks of a model (finite weights, describability) and its fingerprint are made once per
weights version: not repeated on an unchanged model, made again after any edit, and never wrong.

Each check is compared with something independent of it: a brute-force `torch.isfinite` over every
parameter, a forward hook counting the model's forwards, and `model_fingerprint` called directly.
"""

from __future__ import annotations

import json

import pytest
import torch

import entoscope as es
from entoscope.errors import CheckFailedError
from entoscope.models.adapter import adapt
from entoscope.models.fingerprint import model_fingerprint
from entoscope.models.guards import check_finite_weights


def _prompts():
    return ["When Mary and John went to the store, John gave a drink to", "one two three four five six"]


def _forwards(module):
    """A list that grows by one per forward into `module` (a pre-hook: a forward stopped inside it counts)."""
    seen = []
    handle = module.register_forward_pre_hook(lambda *_: seen.append(1))
    return seen, handle


def test_an_unchanged_model_is_not_checked_again_and_an_edit_is():
    model = es.load_model("demo")  # the checks ran at load
    block0, h0 = _forwards(model.blocks[0])
    unembed, h1 = _forwards(model.unembed)
    try:
        for _ in range(3):
            adapt(model)
        assert block0 == [] and unembed == []  # no check forward for the same weights
        with torch.no_grad():
            model.blocks[0].mlp.parameters().__next__().mul_(1.0)  # an in-place edit bumps the version counter
        adapt(model)
        assert len(block0) == 1 and unembed == []  # checked again, once, and only as far as block 0
        adapt(model)
        assert len(block0) == 1
    finally:
        h0.remove(), h1.remove()


def test_the_unembedding_check_rides_on_the_first_forward_with_logits():
    """After an edit, the first lens run makes exactly the forwards a warm run makes: the check that the
    logits are unembed(final_norm(last resid_post)) is made on the run's own forward."""
    model = es.load_model("demo")
    unembed, handle = _forwards(model.unembed)
    try:
        with torch.no_grad():
            model.blocks[1].mlp.parameters().__next__().mul_(1.0)
        es.Lens().run(model, _prompts(), quiet=True)
        first = len(unembed)
        es.Lens().run(model, _prompts(), quiet=True)
        assert first > 0 and first == len(unembed) - first
    finally:
        handle.remove()


def test_reading_the_unembedding_first_makes_its_own_check_forward():
    model = es.load_model("demo")
    with torch.no_grad():
        model.blocks[1].mlp.parameters().__next__().mul_(1.0)
    a = adapt(model)
    unembed, handle = _forwards(model.unembed)
    try:
        W_U = a.weights.W_U
        assert len(unembed) == 1  # the check forward, before W_U was handed out
        a.weights.final_norm, a.weights.b_U
        assert len(unembed) == 1  # once
        torch.testing.assert_close(W_U, model.W_U)
    finally:
        handle.remove()


@pytest.mark.parametrize("how", ["in_place", "replaced", "inf"])
def test_a_non_finite_weight_written_after_the_first_call_is_refused(how):
    model = es.load_model("demo")
    es.Lens().run(model, _prompts(), quiet=True)  # the first call: checks made and remembered
    p = model.blocks[1].mlp.parameters().__next__()
    with torch.no_grad():
        if how == "in_place":
            p[0, 0] = float("nan")
        elif how == "replaced":  # a new tensor behind the same Parameter (no version bump on the old one)
            bad = p.detach().clone()
            bad[1, 2] = float("nan")
            p.data = bad
        else:
            p.view(-1)[-1] = float("inf")
    assert not bool(torch.isfinite(p).all())  # the brute-force answer
    with pytest.raises(CheckFailedError) as err:
        es.Lens().run(model, _prompts(), quiet=True)
    assert err.value.code == "non_finite_weights" and "h.1.mlp" in err.value.message and "1 non-finite" in \
        err.value.message


def test_huge_finite_weights_whose_sum_overflows_are_not_refused():
    model = es.load_model("demo")
    p = model.blocks[0].mlp.parameters().__next__()
    with torch.no_grad():
        p.fill_(3e38)  # every value finite, their float32 sum is inf
    assert bool(torch.isfinite(p).all()) and not bool(torch.isfinite(p.sum()))
    check_finite_weights(model)  # no refusal
    with torch.no_grad():
        p.view(-1)[7] = float("-inf")
    with pytest.raises(CheckFailedError) as err:
        check_finite_weights(model)
    assert "holds 1 non-finite" in err.value.message


def test_the_manifest_fingerprint_is_the_models_and_is_made_when_read(tmp_path):
    model = es.load_model("demo")
    result = es.Lens().run(model, _prompts(), quiet=True)
    expected = model_fingerprint(model)
    assert result.manifest["model"]["fingerprint"] == expected
    folder = result.save(tmp_path / "run")
    assert json.loads((folder / "manifest.json").read_text())["model"]["fingerprint"] == expected


def test_a_fingerprint_is_not_recorded_for_weights_edited_after_the_run(tmp_path):
    model = es.load_model("demo")
    result = es.Lens().run(model, _prompts(), quiet=True)
    before = result.manifest["model"]["structure"]  # reading other keys does not hash
    with torch.no_grad():
        model.blocks[0].mlp.parameters().__next__()[0, 0] += 1.0
    saved = json.loads((result.save(tmp_path / "run") / "manifest.json").read_text())
    assert saved["model"]["fingerprint"] is None  # not the fingerprint of other weights than the run's
    assert saved["model"]["structure"] == before
