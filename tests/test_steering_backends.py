"""Steering on every kind of model: a HookedTransformer (transformer-lens 3.x) and a bridge in compatibility mode
against hand-written run_with_hooks hooks, and the orthogonalised-weights equivalence on a HookedTransformer; an
nnsight assignment that adds the same vector; CachedModel gives the plain model's numbers; grouped-query
attention (a kv head's group) and parallel blocks (no resid_mid in the residual stream) say what the site means."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.models import CachedModel
from entoscope.models.adapter import adapt
from tests.conftest import get_tiny, needs_hooked
from extras import require

TOL = 1e-4
PROMPTS = [[0, 5, 6, 7, 8, 9, 10], [0, 30, 31, 32, 33], [0, 11, 12, 13, 14, 15, 16, 17, 18]]
DATA = es.Dataset("ids", tuple(es.Example(tuple(p), answers=(3,), wrong_answers=(4,)) for p in PROMPTS))


def _vector(width, seed=0, norm=5.0):
    v = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


def _run(model, site, v, coefficients, **kw):
    op = es.Steering(direction=es.Direction(site, v, kw.pop("head", None)), coefficients=coefficients,
                     side_effects=None, stats={"n_boot": 50}, **kw)
    pp = op.run(model, DATA, quiet=True).per_prompt
    return pp[pp.direction == "direction"]


def _kl_mean(steered, clean):
    ls, lu = steered.double().log_softmax(-1), clean.double().log_softmax(-1)
    return float((ls.exp() * (ls - lu)).sum(-1).mean())


def _check_against_hooks(model, hook, site, v, coefficients):
    pp = _run(model, site, v, coefficients)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            clean = model(torch.tensor([p]))[0]
            for c in coefficients:
                steered = model.run_with_hooks(torch.tensor([p]), fwd_hooks=[(hook, lambda x, hook, c=c: x + c * v)])[0]
                row = pp[(pp.example == i) & (pp.coefficient == c)].iloc[0]
                assert row.metric == pytest.approx(float(steered[-1, 3] - steered[-1, 4]), abs=TOL)
                assert row.kl == pytest.approx(_kl_mean(steered, clean), abs=TOL)
    assert pp.effect.abs().max() > 1e-3


@needs_hooked
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hooked_transformer_matches_a_hand_written_hook(family):
    model = get_tiny(family, "hooked", False)
    _check_against_hooks(model, "blocks.1.hook_resid_pre", "resid_pre.1", _vector(model.cfg.d_model), [0.5, 3.0])


@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_a_compat_bridge_matches_a_hand_written_hook(family):
    model = get_tiny(family, "bridge", True)
    _check_against_hooks(model, "blocks.0.hook_mlp_out", "mlp_out.0", _vector(model.cfg.d_model, 2), [-2.0, 1.0])


@needs_hooked
def test_projecting_out_on_a_hooked_transformer_equals_orthogonalised_weights():
    import copy

    model = get_tiny("gpt2", "hooked", False)
    u = _vector(model.cfg.d_model, seed=3, norm=1.0)
    P = torch.eye(len(u)) - torch.outer(u, u)
    ortho = copy.deepcopy(model)
    with torch.no_grad():
        ortho.W_E.copy_(model.W_E @ P)
        ortho.W_pos.copy_(model.W_pos @ P)
        for blk, orig in zip(ortho.blocks, model.blocks):
            blk.attn.W_O.copy_(orig.attn.W_O @ P)
            blk.attn.b_O.copy_(orig.attn.b_O @ P)
            blk.mlp.W_out.copy_(orig.mlp.W_out @ P)
            blk.mlp.b_out.copy_(orig.mlp.b_out @ P)
    pp = _run(model, "resid_pre.0", u, [1.0], at="residual", mode="project_out")
    with torch.no_grad():
        want = [float((lo := ortho(torch.tensor([p]))[0, -1])[3] - lo[4]) for p in PROMPTS]
    np.testing.assert_allclose(pp.sort_values("example").metric.to_numpy(), want, atol=1e-5)


def test_an_nnsight_assignment_that_adds_the_same_vector_gives_the_same_metric_and_kl():
    require("nnsight")
    lm = es.load_model("demo", backend="nnsight")
    v = _vector(128, seed=5, norm=25.0)
    data = es.tasks.ioi(n=4, seed=6)
    coefficients = [-1.0, 1.0]
    r = es.Steering(direction=es.Direction("resid_pre.1", v), coefficients=coefficients, side_effects=None,
                    stats={"n_boot": 50}).run(lm, data, quiet=True)
    pp = r.per_prompt
    a = adapt(lm)
    for i, e in enumerate(data):
        tokens = torch.tensor([a.tokenize(e.prompt)])
        ans, wrong = a.token_id(e.answers[0]), a.token_id(e.wrong_answers[0])
        with torch.no_grad():
            with lm.trace(tokens):
                clean = lm.lm_head.output.save()
            for c in coefficients:
                with lm.trace(tokens):
                    block = lm.transformer.h[1]
                    block.input = block.input + c * v  # resid_pre.1 is block 1's input
                    steered = lm.lm_head.output.save()
                row = pp[(pp.example == i) & (pp.coefficient == c) & (pp.direction == "direction")].iloc[0]
                assert row.metric == pytest.approx(float(steered[0, -1, ans] - steered[0, -1, wrong]), abs=TOL)
                assert row.kl == pytest.approx(_kl_mean(steered[0], clean[0]), abs=TOL)


def test_a_cached_model_gives_the_plain_models_numbers(tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    v = _vector(model.cfg.d_model, seed=6)
    plain = _run(model, "resid_post.0", v, [1.0, 2.0])
    cached = CachedModel(model, cache_dir=tmp_path / "cache")
    first = _run(cached, "resid_post.0", v, [1.0, 2.0])
    again = _run(cached, "resid_post.0", v, [1.0, 2.0])  # the unsteered runs now come from the cache
    for got in (first, again):
        np.testing.assert_allclose(got.metric.to_numpy(), plain.metric.to_numpy(), atol=1e-6)
        np.testing.assert_allclose(got.kl.to_numpy(), plain.kl.to_numpy(), atol=1e-6)


def test_grouped_query_and_parallel_blocks_say_what_the_site_means():
    llama = get_tiny("llama", "bridge", False)
    a = adapt(llama)
    s = a.structure
    assert s.group_size > 1
    op = es.Steering(direction=es.Direction("v.0", _vector(s.d_head), head=1), coefficients=[1.0], side_effects=None,
                     stats={"n_boot": 50})
    plan = op.plan(llama, DATA)
    group = f"query heads {s.group_size}..{2 * s.group_size - 1}"
    assert any(group in n for n in plan.notes), plan.notes
    pp = op.run(llama, DATA, quiet=True).per_prompt
    # by hand: add the vector to kv head 1's values at every position
    hook = a.hook_name("v.0")
    for i, p in enumerate(PROMPTS):
        def fn(x, hook):
            x = x.clone()
            x[:, :, 1] += _vector(s.d_head)
            return x
        with torch.no_grad():
            lo = llama.run_with_hooks(torch.tensor([p]), fwd_hooks=[(hook, fn)])[0, -1]
        got = pp[(pp.example == i) & (pp.direction == "direction")].metric.iloc[0]
        assert got == pytest.approx(float(lo[3] - lo[4]), abs=TOL)
    neox = get_tiny("neox", "bridge", False)
    plan = es.Steering(direction=es.Direction("resid_pre.0", _vector(adapt(neox).structure.d_model)), at="residual",
                       mode="project_out", side_effects=None).plan(neox, DATA)
    written = next(n for n in plan.notes if n.startswith("direction:"))
    assert "resid_mid" not in written and "resid_pre.1" in written
    assert any("parallel blocks" in n for n in plan.notes)
