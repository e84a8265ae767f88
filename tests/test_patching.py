"""Exact patching against TransformerLens's own patching utilities, brute-force hooks written here,
and identities (a full patch is the source run, an identity patch is the base run)."""

import warnings

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.errors import ConfigError, DataError, SiteError, UnknownNameError
from entoscope.models import adapt, load_model
from entoscope.models.tiny import tiny_model
from entoscope.patching import Patching, patch_value

from conftest import get_tiny, has_hooked_transformer, needs_hooked

BACKENDS = [("bridge", False), ("bridge", True)] + ([("hooked", False)] if has_hooked_transformer() else [])


def same_length(data, k, model):
    """k examples of `data` whose prompts have the most common token length (TransformerLens batches need it)."""
    a = adapt(model)
    lengths = [len(a.tokenize(e.prompt)) for e in data]
    common = max(set(lengths), key=lengths.count)
    return Dataset(data.name, tuple(e for e, n in zip(data, lengths) if n == common)[:k])


def random_pairs(n, lengths, seed=0, vocab=300, cf_lengths=None):
    """Pairs of random token ids (BOS 0 first) with one answer and one wrong answer id each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        Lc = L if cf_lengths is None else cf_lengths[i % len(cf_lengths)]
        clean = [0] + torch.randint(1, vocab, (L - 1,), generator=g).tolist()
        corrupt = [0] + torch.randint(1, vocab, (Lc - 1,), generator=g).tolist()
        out.append(Example(tuple(clean), tuple(corrupt), answers=(5 + i,), wrong_answers=(40 + i,)))
    return Dataset("random", tuple(out))


def logit_diff_at_last(logits, lengths, answers, wrong):
    rows = torch.arange(logits.shape[0])
    last = logits[rows, torch.as_tensor(lengths) - 1]
    return last[rows, torch.as_tensor(answers)] - last[rows, torch.as_tensor(wrong)]


def grid(result, index, columns):
    return torch.tensor(result.table.pivot_table(index=index, columns=columns, values="value").values)


# ---------------------------------------------------------------------- against transformer_lens.patching
FULL_CHECK = BACKENDS[-1]  # every kind and the per-position heads on one backend; the others re-check two kinds
TL_CASES = {  # kind, sites over, TransformerLens's function
    "resid_pre": (["layer", "position"], "get_act_patch_resid_pre"),
    "attn_out": (["layer", "position"], "get_act_patch_attn_out"),
    "mlp_out": (["layer", "position"], "get_act_patch_mlp_out"),
    "z": (["layer", "head"], "get_act_patch_attn_head_out_all_pos"),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda v: f"{v[0]}{'-compat' if v[1] else ''}")
def test_exact_equals_transformer_lens_patching(backend):
    from transformer_lens import patching as tlp

    model = load_model("demo", backend=backend[0], compat=backend[1])
    a = adapt(model)
    data = same_length(es.tasks.ioi(n=24, seed=3), 3, model)
    clean = torch.tensor([a.tokenize(e.prompt) for e in data])
    corrupt = torch.tensor([a.tokenize(e.counterfactual) for e in data])
    ans = torch.tensor([a.token_id(e.answers[0]) for e in data])
    wrong = torch.tensor([a.token_id(e.wrong_answers[0]) for e in data])
    rows = torch.arange(len(data))

    def metric(logits):  # the dataset mean of the logit difference at the last position
        return (logits[rows, -1, ans] - logits[rows, -1, wrong]).mean()

    kinds = list(TL_CASES) if backend == FULL_CHECK else ["resid_pre", "z"]
    for direction, (run_tokens, source_tokens) in {"denoising": (corrupt, clean), "noising": (clean, corrupt)}.items():
        _, cache = model.run_with_cache(source_tokens)
        for kind in kinds:
            over, fn = TL_CASES[kind]
            expected = getattr(tlp, fn)(model, run_tokens, cache, metric).double()
            ours = Patching(direction=direction, comparison="absolute", sites=es.Sites(activation=kind, over=over)
                            ).run(model, data, quiet=True)
            got = grid(ours, "layer", "position" if "position" in over else "head")
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
            assert (expected - expected.mean()).abs().max() > 0.1  # the sweep really moves the metric
    if backend != FULL_CHECK:
        return
    # per head and position (192 TransformerLens runs)
    _, cache = model.run_with_cache(clean)
    expected = tlp.get_act_patch_attn_head_out_by_pos(model, corrupt, cache, metric).double()  # [L, pos, H]
    ours = Patching(comparison="absolute", sites=es.Sites(activation="z", over=["layer", "position", "head"]),
                    ).run(model, data, quiet=True).table
    got = torch.zeros_like(expected)
    index = tuple(torch.tensor(ours[c].to_numpy()) for c in ("layer", "position", "head"))
    got[index] = torch.tensor(ours["value"].to_numpy())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- identities on every model family
def test_full_patch_is_the_source_run_and_identity_patch_is_the_base_run(tiny):
    a = adapt(tiny)
    data = random_pairs(3, [7])
    tokens = {k: torch.tensor([getattr(e, k) for e in data]) for k in ("prompt", "counterfactual")}
    lengths, ans, wrong = [7] * 3, [e.answers[0] for e in data], [e.wrong_answers[0] for e in data]
    clean = logit_diff_at_last(a.run(tokens["prompt"]).logits, lengths, ans, wrong).double()
    corrupt = logit_diff_at_last(a.run(tokens["counterfactual"]).logits, lengths, ans, wrong).double()
    full = Patching(sites=es.Sites(activation="resid_pre", over=["layer"], layers=[0]), comparison="absolute")
    for direction, (base, source) in {"denoising": (corrupt, clean), "noising": (clean, corrupt)}.items():
        r = full.model_copy(update={"direction": direction}).run(tiny, data, quiet=True)
        torch.testing.assert_close(r.extra["patched"][:, 0], source, atol=1e-4, rtol=0)
        torch.testing.assert_close(r.extra["m_base"], base, atol=1e-4, rtol=0)
        torch.testing.assert_close(r.extra["m_source"], source, atol=1e-4, rtol=0)
        assert r.per_prompt.normalized.sub(1).abs().max() < 1e-4
    identity = Patching(sites=es.Sites(activation="resid_mid" if not a.structure.parallel else "resid_post",
                                       over=["layer", "position"]),
                        patch="scaled", patch_params={"factor": 1.0}, comparison="absolute")
    r = identity.run(tiny, data, quiet=True)
    torch.testing.assert_close(r.extra["patched"], corrupt[:, None].expand_as(r.extra["patched"]), atol=1e-4, rtol=0)
    # the last layer's residual at the last position IS what the logits are read from
    last = Patching(sites=es.Sites(activation="resid_post", over=["layer", "position"], layers=[-1], positions=[-1]),
                    comparison="absolute").run(tiny, data, quiet=True)
    torch.testing.assert_close(last.extra["patched"][:, 0], clean, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- prefix reuse against the naive path
PREFIX_SITES = [
    es.Sites(activation="resid_pre", over=["layer", "position"], positions=[1, -3, -1]),
    es.Sites(activation="z", over=["layer", "head", "position"], positions=[2, -1]),
    es.Sites(activation="k", over=["layer", "kv_head", "position"], positions=[0, 3]),
    es.Sites(activation="v", over=["layer", "position"], positions=[-2]),
    es.Sites(activation="pattern", over=["layer", "head", "query_pos"], query_positions=[4, -1]),
    es.Sites(activation="mlp_post", over=["layer", "neuron", "position"], neurons=[0, 5], positions=[-2]),
    es.Sites(activation="result", over=["layer", "head"]),
    es.Sites(activation="attn_scores", groups=[[{"layer": 0, "head": 1, "query_pos": 3}, {"layer": 1, "head": 0}]]),
]


PREFIX_CASES = [(f, "hooked", False) for f in ("gpt2", "neox", "llama", "demo")] + \
    [(f, "bridge", False) for f in ("gpt2", "neox", "llama")] + [(f, "bridge", True) for f in ("gpt2", "neox", "llama")]


@pytest.mark.parametrize("case", PREFIX_CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-compat' if c[2] else ''}")
def test_prefix_reuse_equals_the_naive_path(case):
    family, backend, compat = case
    if backend == "hooked" and not has_hooked_transformer():
        pytest.skip("transformer-lens 4.x has no HookedTransformer")
    model = load_model("demo", backend=backend) if family == "demo" else get_tiny(family, backend, compat)
    data = random_pairs(5, [6, 9, 7, 9, 8], seed=1)  # mixed lengths: padded batches, negative positions
    paths = ("positions", "off") if backend == "hooked" and family in ("neox", "llama") else ("positions", "layers", "off")
    site_sets = PREFIX_SITES if not compat else PREFIX_SITES[::3]  # compatibility mode: the same code, fewer kinds
    for sites in site_sets:
        results = {}
        for reuse in paths:
            op = Patching(sites=sites, comparison="absolute", prefix_reuse=reuse, batch_size=7)
            assert ("start at the first changed layer" in str(op.plan(model, data))) == (reuse != "off")
            results[reuse] = op.run(model, data, quiet=True).extra["patched"]
        assert results["off"].std() > 0
        for reuse in paths[:-1]:
            torch.testing.assert_close(results[reuse], results["off"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", [(f, c) for f in ("gpt2", "neox", "llama") for c in (False, True)],
                         ids=lambda c: f"{c[0]}{'-compat' if c[1] else ''}")
def test_bridge_sweep_equals_a_plain_full_forward_sweep(case):
    """The resid_pre layer x position sweep on a bridge (prefix reuse: positions) against one run_with_hooks
    per prompt and cell, written here."""
    model = get_tiny(case[0], "bridge", case[1])
    data = random_pairs(3, [7, 9, 8], seed=4)
    op = Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions=[0, 2, 4, -2, -1]),
                  comparison="absolute", metric="logprob", per_prompt=True)
    result = op.run(model, data, quiet=True)
    assert result.extra["path"] == "positions"
    pp = result.per_prompt
    for e, ex in enumerate(data):
        clean, corrupt = torch.tensor([ex.prompt]), torch.tensor([ex.counterfactual])
        T = clean.shape[1]
        _, cache = model.run_with_cache(clean)
        for L in range(adapt(model).structure.n_layers):
            for p in (0, 2, 4, T - 2, T - 1):
                def hook(x, hook, p=p, name=f"blocks.{L}.hook_resid_pre"):
                    x = x.clone()
                    x[:, p] = cache[name][:, p]
                    return x
                with torch.no_grad():
                    logits = model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", hook)])
                expected = logits[0, -1].log_softmax(-1)[ex.answers[0]]
                got = pp[(pp.example == e) & (pp.layer == L) & (pp.token_position == p)].patched_metric
                assert len(got) == 1 and abs(float(got.iloc[0]) - float(expected)) < 1e-5


# ---------------------------------------------------------------------- a dataset run equals single-pair runs
def test_dataset_per_prompt_values_equal_single_pair_runs():
    model = load_model("demo")
    data = Dataset("mixed", tuple(es.tasks.ioi(n=4, seed=5)) + tuple(es.tasks.greater_than(n=2, seed=5)))
    lengths = {len(adapt(model).tokenize(e.prompt)) for e in data}
    assert len(lengths) > 1
    op = Patching(sites=es.Sites(activation="z", over=["layer", "head", "position"], positions=[-1, -3]),
                  metric="logprob", batch_size=5, stats={"degenerate_share": 0})  # degenerate: relative to the set
    together = op.run(model, data, quiet=True)
    pp = together.per_prompt
    for i in range(len(data)):
        alone = op.run(model, data[i:i + 1], quiet=True).per_prompt
        mine = pp[pp.example == i].reset_index(drop=True)
        for col in ("patched_metric", "base_metric", "source_metric", "normalized"):
            torch.testing.assert_close(torch.tensor(mine[col].to_numpy()), torch.tensor(alone[col].to_numpy()),
                                       atol=1e-5, rtol=1e-5)
        assert list(mine.token) == list(alone.token)
    # the table's normalised value is the ratio of means (mean patched - mean base) / (mean source - mean base),
    # and normalized_mean the mean over prompts of (patched - base) / (source - base)
    g = pp.groupby("site", sort=False)
    ratio = (g.patched_metric.mean() - g.base_metric.mean()) / (g.source_metric.mean() - g.base_metric.mean())
    norm = ((pp.patched_metric - pp.base_metric) / (pp.source_metric - pp.base_metric)).groupby(pp.site, sort=False)
    table = together.table.set_index("site")
    for column, expected in (("value", ratio), ("normalized_mean", norm.mean())):
        torch.testing.assert_close(torch.tensor(table[column].loc[expected.index].to_numpy()),
                                   torch.tensor(expected.to_numpy()), atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------- patch values against hooks written here
def _manual(model, tokens, hook_name, edit, lengths, ans, wrong):
    def hook(x, hook):
        x = x.clone()
        edit(x)
        return x
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[(hook_name, hook)])
    return logit_diff_at_last(logits, lengths, ans, wrong).double()


def test_patch_values_equal_brute_force_hooks():
    model = load_model("demo")
    a = adapt(model)
    data = same_length(es.tasks.ioi(n=24, seed=11), 4, model)
    T = len(a.tokenize(data[0].prompt))
    clean = torch.tensor([a.tokenize(e.prompt) for e in data])
    corrupt = torch.tensor([a.tokenize(e.counterfactual) for e in data])
    ans = [a.token_id(e.answers[0]) for e in data]
    wrong = [a.token_id(e.wrong_answers[0]) for e in data]
    lengths = [T] * len(data)
    name = "blocks.1.hook_resid_pre"
    _, clean_cache = model.run_with_cache(clean)
    _, corrupt_cache = model.run_with_cache(corrupt)
    sites = es.Sites(activation="resid_pre", layers=[1], over=["layer", "position"], positions=[3, -1])

    def ours(**kw):
        return Patching(sites=sites, comparison="absolute", **kw).run(model, data, quiet=True)

    def check(result, edit_for_position, tokens=corrupt):
        for u, p in enumerate([3, T - 1]):
            expected = _manual(model, tokens, name, lambda x: edit_for_position(x, p), lengths, ans, wrong)
            torch.testing.assert_close(result.extra["patched"][:, u], expected, atol=1e-4, rtol=0)

    def put(x, p, value):
        x[:, p] = value

    check(ours(patch="zero"), lambda x, p: put(x, p, 0.0))
    check(ours(patch="scaled", patch_params={"factor": 0.5}), lambda x, p: put(x, p, 0.5 * x[:, p]))
    check(ours(patch="scaled", patch_params={"factor": 2.0, "of": "source"}),
          lambda x, p: put(x, p, 2 * clean_cache[name][:, p]))
    # mean over the dataset of the source-role (clean) runs, per position
    check(ours(patch="mean"), lambda x, p: put(x, p, clean_cache[name][:, p].mean(0)))
    check(ours(patch="mean", patch_params={"per_position": False}),
          lambda x, p: put(x, p, clean_cache[name].mean((0, 1))))
    # noising: the corrupt mean is patched into the clean runs
    check(ours(patch="mean", direction="noising"), lambda x, p: put(x, p, corrupt_cache[name][:, p].mean(0)), clean)
    # resample: another example's source-role run
    r = ours(patch="resample")
    partners = torch.tensor(r.extra["partners"])
    assert (partners != torch.arange(len(data))).all()
    check(r, lambda x, p: put(x, p, clean_cache[name][partners, p]))
    # cross-position: every unit reads the source run's last position
    check(ours(source_position=-1), lambda x, p: put(x, p, clean_cache[name][:, T - 1]))

    @patch_value("test_halfway", needs=("base", "source"), replace=True)
    def halfway(inputs):
        return (inputs.base + inputs.source) / 2

    check(ours(patch="test_halfway"), lambda x, p: put(x, p, (x[:, p] + clean_cache[name][:, p]) / 2))


def test_noise_is_seeded_per_row_and_the_same_on_every_path():
    model = load_model("demo", backend="hooked") if has_hooked_transformer() else load_model("demo")
    twice = random_pairs(1, [9], seed=4)
    data = Dataset("twice", tuple(twice) * 2)  # two identical examples
    sites = es.Sites(activation="resid_pre", over=["layer", "position"], positions=[2, -1])
    runs = [Patching(sites=sites, patch="noise", patch_params={"std": 3.0}, comparison="absolute", batch_size=b,
                     prefix_reuse=reuse, direction="noising").run(model, data, quiet=True).extra["patched"]
            for b, reuse in ((1, "off"), (16, "auto"))]
    torch.testing.assert_close(runs[0], runs[1], atol=1e-4, rtol=0)  # batch- and path-independent draws
    assert (runs[0][0] - runs[0][1]).abs().min() > 1e-4  # a different draw for each row
    zero = Patching(sites=sites, patch="zero", comparison="absolute", direction="noising").run(model, data, quiet=True)
    torch.testing.assert_close(zero.extra["patched"][0], zero.extra["patched"][1])  # same rows without draws
    other_seed = Patching(sites=sites, patch="noise", patch_params={"std": 3.0}, comparison="absolute", seed=1,
                          direction="noising").run(model, data, quiet=True).extra["patched"]
    assert (other_seed - runs[0]).abs().max() > 1e-4
    no_noise = Patching(sites=sites, patch="noise", patch_params={"std": 0.0}, comparison="difference",
                        direction="noising").run(model, data, quiet=True)
    assert no_noise.table.value.abs().max() < 1e-5


def test_pairs_of_different_lengths_align_on_their_ends():
    model = load_model("demo")
    a = adapt(model)
    data = random_pairs(3, [8, 9, 7], cf_lengths=[10, 12, 9], seed=2)
    with pytest.raises(DataError, match=r"pair 0: the prompt is 8 tokens and its counterfactual 10") as err:
        Patching().plan(model, data)
    assert err.value.code == "lengths_differ"
    r = Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], layers=[1], positions=[-1, -2]),
                 align="end", direction="noising", comparison="absolute").run(model, data, quiet=True)
    for i, e in enumerate(data):
        clean, corrupt = torch.tensor([e.prompt]), torch.tensor([e.counterfactual])
        _, cache = model.run_with_cache(corrupt)
        src = cache["blocks.1.hook_resid_pre"][0]
        for u, k in enumerate([-1, -2]):
            expected = _manual(model, clean, "blocks.1.hook_resid_pre",
                               lambda x: x[:, len(e.prompt) + k].copy_(src[len(e.counterfactual) + k]),
                               [len(e.prompt)], [e.answers[0]], [e.wrong_answers[0]])
            assert abs(float(r.extra["patched"][i, u]) - float(expected[0])) < 1e-4
    # every position of a longer base run has no aligned source position: refused at plan time
    with pytest.raises(SiteError, match="pair 0") as err:
        Patching(sites=es.Sites(activation="resid_pre", over=["layer"]), align="end", direction="denoising"
                 ).plan(model, data)
    assert err.value.code == "positions_unaligned"
    assert a.structure.n_layers == 3


# ---------------------------------------------------------------------- grouped-query attention
@needs_hooked  # the reference is a HookedTransformer with ungrouped key/value heads
def test_query_head_copies_of_k_and_v_equal_transformer_lens_ungrouped():
    reference = tiny_model("llama", "hooked")
    reference.set_ungroup_grouped_query_attention(True)  # hook_k/hook_v then have one head per query head
    data = random_pairs(2, [8], seed=6)
    clean = torch.tensor([e.prompt for e in data])
    corrupt = torch.tensor([e.counterfactual for e in data])
    ans, wrong = [e.answers[0] for e in data], [e.wrong_answers[0] for e in data]
    _, cache = reference.run_with_cache(clean)

    def tl(kind, head, pos):
        name = f"blocks.1.attn.hook_{kind}"
        return _manual(reference, corrupt, name, lambda x: x[:, pos, head].copy_(cache[name][:, pos, head]),
                       [8, 8], ans, wrong)

    for backend, compat in BACKENDS:
        model = tiny_model("llama", backend, compat)
        for kind in ("k", "v"):
            for over, positions in ((["layer", "head", "position"], [2, 6]), (["layer", "head"], "all")):
                sites = es.Sites(activation=kind, over=over, layers=[1], positions=positions)
                own = Patching(sites=sites, kv_mode="query_head", comparison="absolute").run(model, data, quiet=True)
                group = Patching(sites=sites, kv_mode="group", comparison="absolute").run(model, data, quiet=True)
                assert set(own.table.kv_copy) == {"query head's own copy"}
                assert set(group.table.kv_copy) == {"key/value head (whole group)"}
                for u, row in enumerate(own.table.itertuples()):
                    pos = slice(None) if positions == "all" else int(row.position)
                    torch.testing.assert_close(own.extra["patched"][:, u], tl(kind, int(row.head), pos),
                                               atol=1e-5, rtol=0)
                # group mode patches key/value head h // 2 for both of its query heads
                g = group.extra["patched"]
                if over == ["layer", "head"]:  # units h0..h3: h0, h1 share key/value head 0; h2, h3 head 1
                    torch.testing.assert_close(g[:, 0::2], g[:, 1::2])
                assert (own.extra["patched"] - g).abs().max() > 1e-6


# ---------------------------------------------------------------------- degenerate pairs, refusals, outputs
def test_a_pair_with_equal_metrics_is_flagged_not_warned():
    model = load_model("demo")
    ioi = list(es.tasks.ioi(n=3, seed=1))
    same = Example(ioi[0].prompt, ioi[0].prompt, ioi[0].answers, ioi[0].wrong_answers)
    data = Dataset("with_a_degenerate_pair", (same, ioi[1], ioi[2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=r"\[screen_blind\]")  # 3 pairs: no cell can be a discovery
        r = Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions=[-1])
                     ).run(model, data, quiet=True)
    pp = r.per_prompt
    assert pp[pp.example == 0].normalized.isna().all() and pp[pp.example == 0].degenerate.all()
    assert pp[pp.example > 0].normalized.notna().all() and not pp[pp.example > 0].degenerate.any()
    assert (r.table.n_degenerate == 1).all() and r.extra["n_degenerate"] == 1
    assert "1 of 3 pairs are degenerate" in r.page_warnings[0]["message"]  # the page's warnings box
    expected = pp[pp.example > 0].groupby("site", sort=False).normalized.mean()  # per-pair ratios: without it
    assert torch.allclose(torch.tensor(r.table.normalized_mean.to_numpy()), torch.tensor(expected.to_numpy()))


def test_refusals_at_plan_time_run_no_model():
    model = load_model("demo")

    def no_runs(*args, **kwargs):
        raise AssertionError("plan ran the model")

    model.run_with_cache = no_runs
    model.run_with_hooks = no_runs
    ioi = es.tasks.ioi(n=4, seed=0)
    plain = Dataset("plain", tuple(Example(e.prompt, answers=e.answers, wrong_answers=e.wrong_answers) for e in ioi))
    print(Patching().plan(model, ioi))  # a plan that passes runs nothing either
    cases = [
        (dict(), plain, DataError, "data_no_counterfactuals"),
        (dict(method="integrated_gradients", patch="noise"), ioi, ConfigError, "ig_per_row_patch"),
        (dict(method="attribution", kv_mode="query_head", sites=es.Sites(activation="k", over=["layer", "head"])),
         ioi, None, None),  # the demo model has no grouped-query attention: nothing to refuse
        (dict(patch="no_such_value"), ioi, UnknownNameError, "unknown_patch"),
        (dict(patch="noise", patch_params={"sigma": 1}), ioi, ConfigError, "patch_param_unknown"),
        (dict(patch="mean", patch_params={"per_position": False},
              sites=es.Sites(activation="pattern", over=["layer", "head"])), ioi, ConfigError,
         "mean_over_positions_pattern"),
        (dict(source_position=-1, sites=es.Sites(activation="z", over=["layer", "head"])), ioi, SiteError,
         "source_position_needs_position"),
        (dict(metric="logit_diff", direction="noising", comparison="difference", patch="zero"),
         Dataset("no_answers", tuple(Example(e.prompt) for e in ioi)), DataError, "metric_needs_answers"),
        (dict(sites=es.Sites(activation="logits", over=["position"])), ioi, SiteError, "site_not_writable"),
    ]
    for config, data, error, code in cases:
        if error is None:
            Patching(**config).plan(model, data)
            continue
        with pytest.raises(error) as err:
            Patching(**config).plan(model, data)
        assert err.value.code == code, (config, err.value)
    llama = tiny_model("llama", "bridge")
    with pytest.raises(ConfigError) as err:
        Patching(method="attribution", kv_mode="query_head", sites=es.Sites(activation="v", over=["layer", "head"])
                 ).plan(llama, random_pairs(2, [6]))
    assert err.value.code == "query_head_exact_only"


def test_result_saves_a_page_and_the_yaml_examples_plan(tmp_path):
    import yaml

    from entoscope.config import build_operation

    model = load_model("demo")
    r = Patching(sites=es.Sites(activation="z", over=["layer", "head"])).run(model, es.tasks.ioi(n=3), quiet=True)
    folder = r.save(tmp_path / "run")
    page = (folder / "index.html").read_text()
    assert "by layer and head" in page and "per prompt" in page
    assert (folder / "per_prompt.csv").exists() and (folder / "table.parquet").exists()
    lp = Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions="-4:")).run(
        model, es.tasks.ioi(n=2), quiet=True)
    title, fig = lp.figures()[0]
    last_token = adapt(model).vocab_strings()[adapt(model).tokenize(es.tasks.ioi(n=2)[0].counterfactual)[-1]]
    assert "layer and position" in title and fig.data[0].x[-1] == f"END: {last_token!r}"
    entries = yaml.safe_load(open("examples/patching.yaml"))
    assert {"ioi_resid_pre", "greater_than_mlp"} <= set(entries)
    for name, entry in entries.items():
        op, spec = build_operation(entry, where=name)
        plan = op.plan(model, spec.model_copy(update={"n": 4}) if spec.n else spec)
        assert plan.rows > 0, name


def test_a_position_selection_without_a_position_axis_patches_only_those_positions():
    """Issue 37: Sites(over=[layer], positions=[-1]) patched every position (normalised effect 1 at the
    first layer); it patches each prompt's last token at every layer: one run_with_hooks per prompt and
    layer written here. positions=[-2, -1] patches both tokens together in one row."""
    model = load_model("demo")
    data = random_pairs(3, [7, 9, 8], seed=6)
    n_layers = adapt(model).structure.n_layers
    for offsets in ([-1], [-2, -1]):
        op = Patching(sites=es.Sites(activation="resid_pre", over=["layer"], positions=offsets),
                      comparison="absolute", metric="logprob")
        result = op.run(model, data, quiet=True)
        got = result.extra["patched"]  # [prompts, layers]
        assert got.shape == (len(data), n_layers)
        for e, ex in enumerate(data):
            clean, corrupt = torch.tensor([ex.prompt]), torch.tensor([ex.counterfactual])
            T = clean.shape[1]
            _, cache = model.run_with_cache(clean)
            for L in range(n_layers):
                name = f"blocks.{L}.hook_resid_pre"

                def hook(x, hook, name=name):
                    x = x.clone()
                    for p in offsets:
                        x[:, T + p] = cache[name][:, T + p]
                    return x
                with torch.no_grad():
                    logits = model.run_with_hooks(corrupt, fwd_hooks=[(name, hook)])
                expected = logits[0, -1].log_softmax(-1)[ex.answers[0]]
                assert abs(float(got[e, L]) - float(expected)) < 1e-4, (offsets, e, L)
        # at layer 0 the patched residual differs from the clean one except at the patched tokens, so the
        # patched run is not the clean run (it was, exactly, when every position was patched)
        assert (got[:, 0] - result.extra["m_source"]).abs().max() > 1e-3
