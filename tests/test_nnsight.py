"""The nnsight backend against the plain TransformerBridge on the same HuggingFace weights (the bridge is
checked against independent references in test_models.py): every site read, written and differentiated,
every operation's table, the demo model; and what only nnsight has (resid_mid written as the residual,
refusals, CachedModel, loading). Skipped where nnsight is not installed; CI sets
ENTOSCOPE_REQUIRE_NNSIGHT=1 so that a missing nnsight fails instead."""


import numpy as np
import pandas as pd
import pytest

from extras import require
import torch

require("nnsight")

import entoscope as es  # noqa: E402
from entoscope.data import Dataset, Example  # noqa: E402
from entoscope.errors import ConfigError, SiteError, UnsupportedModelError  # noqa: E402
from entoscope.models import CachedModel, Intervention, adapt  # noqa: E402
from entoscope.models.fingerprint import model_fingerprint  # noqa: E402
from entoscope.models.loading import from_hf  # noqa: E402
from entoscope.models.tiny import tiny_hf_model, tiny_tokenizer, tokenizer_dir  # noqa: E402

FAMILIES = ["gpt2", "neox", "llama"]
TOL = 1e-5
_PAIRS: dict = {}


def pair(family):
    """(plain bridge, nnsight model) on two copies of the same random HuggingFace weights."""
    if family not in _PAIRS:
        if family == "demo":
            _PAIRS[family] = (es.load_model("demo"), es.load_model("demo", backend="nnsight"))
        else:
            bridge = from_hf(tiny_hf_model(family), tiny_tokenizer(), name=f"tiny-{family}", folder=tokenizer_dir())
            nn = from_hf(tiny_hf_model(family), tiny_tokenizer(), backend="nnsight", name=f"tiny-{family}")
            _PAIRS[family] = (bridge, nn)
    return _PAIRS[family]


TOKENS = torch.tensor([[0, 5, 6, 7, 8, 9, 10], [0, 9, 10, 11, 12, 13, 14]])
KINDS = ["embed", "pos_embed", "resid_pre", "ln1_scale", "attn_in", "q", "k", "v", "attn_scores", "pattern", "z",
         "result", "attn_out", "resid_mid", "ln2_scale", "mlp_in", "mlp_pre", "mlp_post", "mlp_out", "resid_post",
         "final_scale"]


def names_for(a):
    out = []
    for k in KINDS:
        for n in ([k] if k in ("embed", "pos_embed", "final_scale") else [f"{k}.0", f"{k}.1"]):
            try:
                a.resolve(n)
            except SiteError:
                continue
            out.append(n)
    return out


def close(x, y, tol=TOL):
    assert x.shape == y.shape
    finite = torch.isfinite(x)
    assert torch.equal(finite, torch.isfinite(y))
    return float((x[finite] - y[finite]).abs().max()) <= tol * (1 + float(x[finite].abs().max()))


# ---------------------------------------------------------------- the model layer
@pytest.mark.parametrize("family", FAMILIES)
def test_structure_and_weights_are_the_bridges(family):
    b, n = (adapt(m) for m in pair(family))
    assert {**b.structure.as_dict(), "backend": "nnsight"} == n.structure.as_dict()
    wb, wn = b.weights, n.weights
    checks = [("W_E", wb.W_E, wn.W_E), ("W_U", wb.W_U, wn.W_U), ("b_U", wb.b_U, wn.b_U)]
    if b.structure.positional == "learned":
        checks.append(("W_pos", wb.W_pos, wn.W_pos))
    for L in range(b.structure.n_layers):
        for name in ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_K_kv", "W_V_kv", "W_O", "b_O", "W_in", "b_in",
                     "W_out", "b_out"):
            checks.append((f"{name}.{L}", getattr(wb, name)(L), getattr(wn, name)(L)))
        if b.structure.gated_mlp:
            checks.append((f"W_gate.{L}", wb.W_gate(L), wn.W_gate(L)))
        for which in ("ln1", "ln2"):
            nb, nn_ = wb.norm(L, which), wn.norm(L, which)
            checks.append((f"{which}.{L}", nb.weight, nn_.weight))
            assert nb.eps == nn_.eps and (nb.bias is None) == (nn_.bias is None)
    for what, x, y in checks:
        assert torch.allclose(x.detach(), y.detach(), atol=0, rtol=0), what


@pytest.mark.parametrize("family", FAMILIES)
def test_every_site_reads_as_on_the_bridge(family):
    b, n = (adapt(m) for m in pair(family))
    names = names_for(b)
    rb, rn = b.run(TOKENS, names), n.run(TOKENS, names)
    assert close(rb.logits, rn.logits)
    for name in names:
        assert close(rb[name], rn[name]), name


def _change(kind, x, g):
    if kind == "pattern":
        return 0.5 * x + 0.5 * x.roll(1, -2)
    if kind.endswith("_scale"):
        return 1.5 * x
    return x + 0.3 * torch.randn(x.shape, generator=g).to(x.dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_site_writes_and_differentiates_as_on_the_bridge(family):
    b, n = (adapt(m) for m in pair(family))
    base = b.run(TOKENS).logits
    for name in names_for(b):
        kind = name.split(".")[0]
        if kind == "resid_mid":
            continue  # the bridge writes only the MLP's input there (below)
        g = torch.Generator().manual_seed(1)
        shape = b.run(TOKENS, [name])[name].shape
        delta = _change(kind, torch.zeros(shape), g) if kind not in ("pattern",) and not kind.endswith("_scale") else None

        def fn(x, kind=kind, delta=delta):
            return x + delta.to(x.dtype) if delta is not None else _change(kind, x, g)
        lb = b.run(TOKENS, interventions=[Intervention(name, fn)]).logits
        ln = n.run(TOKENS, interventions=[Intervention(name, fn)]).logits
        assert (lb - base).abs().max() > 1e-3, name  # the write changed something
        assert close(lb, ln), name
        if kind == "result" or kind.endswith("_scale"):
            continue  # derived on the bridge: off its autograd path (the bridge's norm scales are too)
        with torch.enable_grad():
            rb, rn = b.run(TOKENS, [name], grad=True), n.run(TOKENS, [name], grad=True)
            gb, = torch.autograd.grad(rb.logits[:, -1, 3].sum(), rb[name])
            gn, = torch.autograd.grad(rn.logits[:, -1, 3].sum(), rn[name])
        assert close(gb, gn), name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_writing_resid_mid_writes_the_residual_stream(family):
    """A full resid_mid patch with the source run's values reproduces the source run (the MLP and the skip
    connection both read the new residual), on nnsight and on the bridge (whose hook_resid_mid is only its
    second norm's input: entoscope writes resid_mid there through attn_out)."""
    b, n = (adapt(m) for m in pair(family))
    source = torch.tensor([[0, 20, 21, 22, 23, 24, 25], [0, 30, 31, 32, 33, 34, 35]])
    for L in (0, 1):
        mid = n.run(source, [f"resid_mid.{L}"])[f"resid_mid.{L}"]
        patched = n.run(TOKENS, interventions=[Intervention.replace(f"resid_mid.{L}", mid)]).logits
        assert close(n.run(source).logits, patched)
        on_bridge = b.run(TOKENS, interventions=[Intervention.replace(f"resid_mid.{L}", mid)]).logits
        assert close(b.run(source).logits, on_bridge)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_and_stopped_runs_are_the_full_runs(family):
    n = adapt(pair(family)[1])
    full = n.run(TOKENS, ["resid_post.0"])
    stopped = n.run(TOKENS, ["resid_post.0"], logits=False)
    assert stopped.logits is None and torch.equal(full["resid_post.0"], stopped["resid_post.0"])
    at = n.run(TOKENS, logits_at=torch.tensor([3, 6])).logits
    assert close(at, full.logits[torch.arange(2), torch.tensor([3, 6])])


# ---------------------------------------------------------------- every operation, the same table
def tiny_pairs(k=4, T=8, labels=False):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(k):
        clean = [0] + torch.randint(1, 300, (T - 1,), generator=g).tolist()
        corrupt = clean[:2] + torch.randint(1, 300, (T - 2,), generator=g).tolist()
        out.append(Example(tuple(clean), tuple(corrupt), answers=(5 + i,), wrong_answers=(40 + i,),
                           label=i % 2 if labels else None))
    return Dataset("random", tuple(out))


def _noise_rows(t, col):
    """Rows of a statistic whose standard error is at float32 noise level: there the p-value and the most
    influential prompt are ratios of noise to noise (an exactly-zero cell on one backend is 1e-9 on the
    other), so only the value, its interval and its se are compared."""
    stem = next((col[: -len(sfx)] for sfx in ("_p", "_influence", "_q", "_significant") if col.endswith(sfx)), None)
    if stem is None or f"{stem}_se" not in t.columns:
        return np.zeros(len(t), dtype=bool)
    return (t[f"{stem}_se"].to_numpy(float) <= 1e-5 * (1 + np.abs(t[stem].to_numpy(float)))) if stem in t else \
        (t[f"{stem}_se"].to_numpy(float) <= 1e-5)


def assert_same_table(tb, tn, what):
    assert list(tb.columns) == list(tn.columns), what
    assert len(tb) == len(tn), what
    for t in (tb, tn):  # p is the inversion of the table's own interval (tests/test_pvalues.py), on each backend
        for col in [c for c in t.columns if c.endswith("_p") and f"{c[:-2]}_ci_low" in t]:
            lo = t["difference_ci_low" if "difference_ci_low" in t else f"{col[:-2]}_ci_low"].to_numpy(float)
            hi = t["difference_ci_high" if "difference_ci_high" in t else f"{col[:-2]}_ci_high"].to_numpy(float)
            p = t[col].to_numpy(float)
            ok = np.isfinite(p) & np.isfinite(lo)
            # a p held at 2^-(n-1), the sign-flip limit on n <= 5 prompts, may disagree (docs/statistics.md)
            ok &= ~np.isin(p, [2.0 ** -(n - 1) for n in range(2, 6)])
            assert np.array_equal((p < 1 - t["ci_level"].iloc[0])[ok], ((lo > 0) | (hi < 0))[ok]), (what, col)
    for col in tb.columns:
        if "_influential" in col or col.endswith(("_q", "_p", "_p_bound")) or col == "significant":
            continue  # an argmax over prompts; p counts the resamples beyond 0, and a resample at 0 within
            # float32 noise (a prompt whose effect is 0 on one backend and 1e-9 on the other, drawn alone)
            # falls on either side: p is checked against its own interval above, the intervals here;
            # Benjamini-Hochberg's step-up ranks turn that noise into different q-values
        keep = ~_noise_rows(tb, col)
        a, c = tb[col].to_numpy()[keep], tn[col].to_numpy()[keep]
        if pd.api.types.is_numeric_dtype(tb[col]) and not pd.api.types.is_bool_dtype(tb[col]):
            a, c = a.astype(float), c.astype(float)
            assert np.array_equal(np.isnan(a), np.isnan(c)), (what, col)
            ok = ~np.isnan(a)
            tol = TOL * (1 + np.abs(a))
            assert np.all(np.abs(a[ok] - c[ok]) <= tol[ok]), (what, col, float(np.nanmax(np.abs(a - c))))
        else:
            assert list(map(str, a)) == list(map(str, c)), (what, col)


# comparison "difference": on random tiny models the source-base gap of some prompts is near zero, and a
# ratio of means over resamples that hit those is ill-conditioned (its interval moves with float32 noise)
# percentile intervals: BCa's bias correction counts resamples below the value, and on 4 prompts many
# resamples tie with it, so float32 noise moves that count (and the interval) by whole steps
PCT = {"ci_method": "expanded_percentile"}
OPERATIONS = {
    "lens": lambda: es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"])),
    "patching_exact": lambda: es.Patching(comparison="difference", stats=PCT, method="exact", sites=es.Sites(activation="resid_pre",
                                                                         over=["layer", "position"])),
    "patching_exact_heads": lambda: es.Patching(comparison="difference", stats=PCT, method="exact", sites=es.Sites(activation="pattern",
                                                                               over=["layer", "head"])),
    "patching_attribution": lambda: es.Patching(comparison="difference", stats=PCT, method="attribution", sites=es.Sites(activation="z",
                                                                                     over=["layer", "head"])),
    "patching_ig": lambda: es.Patching(method="integrated_gradients", ig_steps=3, comparison="difference", stats=PCT,
                                       sites=es.Sites(activation="attn_out", over=["layer"])),
    "probing": lambda: es.Probing(sites=es.Sites(activation="resid_post", over=["layer"])),
    "dla": lambda: es.DirectLogitAttribution(),
    "head_scores": lambda: es.HeadScores(),
    "circuits_eap": lambda: es.Circuits(method="eap", n_edges=6, stats=PCT, faithfulness=[0.5]),
    "circuits_eap_ig": lambda: es.Circuits(method="eap_ig", steps=3, n_edges=6, stats=PCT, faithfulness=[]),
    "ifr": lambda: es.InformationFlowRoutes(),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
@pytest.mark.parametrize("family", FAMILIES + ["demo"])
def test_every_operation_gives_the_bridges_table(family, op):
    bridge, nn = pair(family)
    n = 16 if op == "probing" else 4
    if family == "demo":
        data = es.tasks.ioi(n=n)
    elif op == "head_scores":  # repeated random tokens: duplicate-token, previous-token and induction targets
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(1, 300, (6,), generator=g).tolist() for _ in range(3)]
        data = Dataset("repeats", tuple(Example(tuple([0] + s_ + s_)) for s_ in seqs))
    else:
        data = tiny_pairs(n, labels=op == "probing")
    rb = OPERATIONS[op]().run(bridge, data, quiet=True)
    rn = OPERATIONS[op]().run(nn, data, quiet=True)
    assert_same_table(rb.table, rn.table, f"{op} table")
    if getattr(rb, "per_prompt", None) is not None:
        assert_same_table(rb.per_prompt, rn.per_prompt, f"{op} per_prompt")


def test_query_head_keys_are_patched_as_on_the_bridge():
    """kv_mode query_head under rotary reads the rotated q and k (taps) and writes the scores."""
    bridge, nn = pair("llama")
    op = lambda: es.Patching(method="exact", kv_mode="query_head",  # noqa: E731
                             sites=es.Sites(activation="k", layers=[1], over=["layer", "kv_head", "position"]))
    data = tiny_pairs(4)
    assert_same_table(op().run(bridge, data, quiet=True).table, op().run(nn, data, quiet=True).table, "query_head k")


def test_patched_runs_are_full_forwards_and_the_plan_says_so():
    nn = pair("gpt2")[1]
    plan = es.Patching(comparison="difference", stats=PCT, method="exact", sites=es.Sites(activation="resid_pre", over=["layer"])).plan(nn, tiny_pairs(2))
    assert "every patched run is a full forward" in str(plan)
    with pytest.raises(ConfigError) as err:
        es.Patching(method="exact", prefix_reuse="layers",
                    sites=es.Sites(activation="resid_pre", over=["layer"])).plan(nn, tiny_pairs(2))
    assert err.value.code == "prefix_reuse_unsupported"


# ---------------------------------------------------------------- CachedModel, fingerprint, loading, refusals
def test_cached_model_around_nnsight_reads_back_and_sees_the_weights(tmp_path):
    nn = from_hf(tiny_hf_model("gpt2", seed=3), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    fresh = adapt(nn).run(TOKENS, ["resid_post.0", "z.1"])
    cached = CachedModel(nn, cache_dir=tmp_path)
    first = adapt(cached).run(TOKENS, ["resid_post.0", "z.1"])
    second = adapt(cached).run(TOKENS, ["resid_post.0", "z.1"])
    stats = cached.cache_stats()
    assert stats["misses"] == 1 and stats["hits"] == 1
    for name in ("resid_post.0", "z.1"):
        assert torch.equal(fresh[name], second[name]) and torch.equal(first[name], second[name])
    assert torch.equal(fresh.logits, second.logits)
    hf = nn.__dict__["_module"]
    before = model_fingerprint(nn)
    assert before == model_fingerprint(hf) == model_fingerprint(cached)
    with torch.no_grad():
        hf.transformer.h[1].mlp.c_fc.weight[0, 0] += 1.0
    assert model_fingerprint(nn) != before
    changed = adapt(cached).run(TOKENS, ["resid_post.0", "z.1"])  # a miss: recomputed with the new weight
    assert cached.cache_stats()["misses"] == 2
    assert torch.equal(changed["resid_post.0"], fresh["resid_post.0"])  # layer 0 is untouched
    assert not torch.equal(changed.logits, fresh.logits)


def test_load_model_and_the_command_line_take_the_nnsight_backend(tmp_path, capsys):
    model = es.load_model("demo", backend="nnsight")
    a = adapt(model)
    assert (a.structure.backend, a.structure.mode) == ("nnsight", "plain")
    assert a.module._entoscope_source["backend"] == "nnsight"
    from entoscope.cli import main

    out = tmp_path / "lens"
    code = main(["lens", "--model", "demo", "--backend", "nnsight", "--data", "{task: ioi, n: 4}",
                 "--sites", "{activation: resid_post, over: [layer]}", "--out", str(out)])
    assert code in (0, None) and (out / "table.csv").exists()
    bridge = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(es.load_model("demo"),
                                                                                  es.tasks.ioi(n=4), quiet=True)
    assert np.allclose(pd.read_csv(out / "table.csv")["kl_mean"], bridge.table["kl_mean"], atol=TOL)


def test_an_unknown_family_is_refused_with_its_code():
    from nnsight import NNsight
    from transformers import GPTJConfig, GPTJForCausalLM

    hf = GPTJForCausalLM(GPTJConfig(n_layer=1, n_embd=32, n_head=2, rotary_dim=8, vocab_size=50, n_positions=16))
    with pytest.raises(UnsupportedModelError) as err:
        adapt(NNsight(hf))
    assert err.value.code == "hf_family_unknown" and "GPTJForCausalLM" in err.value.message


def test_attention_entoscope_cannot_reproduce_refuses_the_derived_head_sites():
    """An attention function that changes the scores (here doubled before the softmax) is one entoscope's
    pattern does not model: pattern, scores and rotated q/k are refused; q, k, v, z still served."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def doubled(module, query, key, value, attention_mask, scaling, **kw):
        T = query.shape[-2]
        causal = torch.full((T, T), torch.finfo(query.dtype).min).triu(1)[None, None]
        return eager_attention_forward(module, query, key, value, causal, scaling=2 * scaling, **kw)

    AttentionInterface.register("entoscope_test_doubled", doubled)
    hf = tiny_hf_model("llama", seed=4)
    hf.config._attn_implementation = "entoscope_test_doubled"
    n = adapt(from_hf(hf, tiny_tokenizer(), backend="nnsight", name="odd"))
    with pytest.raises(SiteError) as err:
        n.run(TOKENS, ["pattern.0"])
    assert err.value.code == "nnsight_heads_unavailable"
    z = n.run(TOKENS, ["z.0"])["z.0"]
    assert z.shape == (2, 7, 4, 16) and torch.isfinite(z).all()


def test_missing_nnsight_is_refused_with_the_install_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_nnsight(name, *args, **kwargs):
        if name == "nnsight" or name.startswith("nnsight."):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_nnsight)
    with pytest.raises(ConfigError) as err:
        es.load_model("demo", backend="nnsight")
    assert err.value.code == "nnsight_missing" and "entoscope[nnsight]" in err.value.remedy


def test_remote_is_passed_to_every_trace(monkeypatch):
    """use_remote(model, ...) gives every trace entoscope's bounded remote backend (nnsight's RemoteBackend with
    timeouts); "local" passes remote="local", nnsight's serialising dry run."""
    from nnsight.intervention.backends.remote import RemoteBackend

    from entoscope.models.nnsight_backend import use_remote

    nn = from_hf(tiny_hf_model("gpt2", seed=5), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    seen = []
    real = type(nn).trace

    def spy(self, *args, **kwargs):
        seen.append(kwargs.pop("backend", None) or kwargs.get("remote"))
        return real(self, *args, **{**kwargs, "remote": False})
    monkeypatch.setattr(type(nn), "trace", spy)
    use_remote(nn, True, host="http://ndif.example:5001", timeout=7, model_key="k")
    adapt(nn).run(TOKENS, ["resid_post.0"])
    assert seen and all(isinstance(b, RemoteBackend) and b.host == "http://ndif.example:5001" and b.model_key == "k"
                        for b in seen)
    seen.clear()
    use_remote(nn, "local")
    adapt(nn).run(TOKENS, ["resid_post.0"])
    assert seen and all(r == "local" for r in seen)



def test_the_heads_check_runs_once_per_weights_version():
    """NNsightBackend.check_sites' 4-token forward, counted with a forward pre-hook on the last attention module (the check stops inside it):
    not repeated when the same model is adapted again, made again after an in-place weight edit, and its
    verdict (pattern @ v is z, so rotated q/k and the pattern are served) the same both times."""
    model = from_hf(tiny_hf_model("gpt2"), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2-once")
    module = adapt(model).module
    seen, first = [], []  # forwards into the last attention (the heads check), into block 0 (both checks)
    handle = module.transformer.h[-1].attn.register_forward_pre_hook(lambda *_: seen.append(1))
    handle0 = module.transformer.h[0].register_forward_pre_hook(lambda *_: first.append(1))
    try:
        for _ in range(3):
            a = adapt(model)
        assert seen == [] and first == [] and a.backend._heads_refused is None
        with torch.no_grad():
            next(module.transformer.h[0].parameters()).mul_(1.0)  # an in-place edit bumps the version counter
        a = adapt(model)
        # the heads check once, and the describability check once (it stops after block 0)
        assert len(seen) == 1 and len(first) == 2
        assert a.backend._heads_refused is None
        adapt(model)
        assert len(seen) == 1 and len(first) == 2
    finally:
        handle0.remove()
        handle.remove()
