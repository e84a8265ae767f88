"""The lens against TransformerLens's own utilities, the model's own logits, and one-prompt runs."""

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset
from entoscope.lens.tuned import TunedLens
from entoscope.models import adapt, load_model

from wilson_by_hand import wilson_by_hand
from conftest import has_hooked_transformer

BACKENDS = [("bridge", False), ("bridge", True)] + ([("hooked", False)] if has_hooked_transformer() else [])


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda v: f"{v[0]}{'-compat' if v[1] else ''}")
def demo(request):
    return load_model("demo", backend=request.param[0], compat=request.param[1])


def _ioi(n=4, seed=0):
    return es.tasks.ioi(n=n, seed=seed)


def test_logit_lens_equals_transformer_lens_accumulated_resid(demo):
    data = _ioi(3)
    a = adapt(demo)
    L = a.structure.n_layers
    result = es.Lens(sites=es.Sites(activation="resid_pre", over=["layer", "position"])).run(demo, data, quiet=True)
    pp = result.per_prompt
    for i, ex in enumerate(data):
        tokens = demo.to_tokens(ex.prompt, prepend_bos=True)
        _, cache = demo.run_with_cache(tokens)
        acc = cache.accumulated_resid(layer=-1, incl_mid=False, apply_ln=True)  # [L+1, 1, T, d]
        tl_logits = acc @ demo.W_U + demo.b_U  # TransformerLens's logit lens, [L+1, 1, T, V]
        target = a.token_id(ex.answers[0])
        for layer in range(L):
            rows = pp[(pp.example == i) & (pp.layer == layer)].sort_values("token_position")
            expected = tl_logits[layer, 0, rows.token_position.to_numpy(), target]
            torch.testing.assert_close(torch.tensor(rows.target_logit.to_numpy(), dtype=torch.float32),
                                       expected.float(), atol=2e-4, rtol=1e-4)


def test_last_layer_lens_is_the_models_own_output(demo):
    data = _ioi(3)
    a = adapt(demo)
    last = a.structure.n_layers - 1
    result = es.Lens(sites=es.Sites(activation="resid_post", layers=[last], over=["layer", "position"])).run(
        demo, data, quiet=True)
    pp = result.per_prompt
    assert pp.kl_to_final.abs().max() < 1e-5
    for i, ex in enumerate(data):
        logits = demo(demo.to_tokens(ex.prompt, prepend_bos=True))[0]
        rows = pp[pp.example == i].sort_values("token_position")
        target = a.token_id(ex.answers[0])
        torch.testing.assert_close(torch.tensor(rows.target_logit.to_numpy(), dtype=torch.float32),
                                   logits[rows.token_position.to_numpy(), target].float(), atol=1e-4, rtol=1e-5)


def test_dataset_run_equals_single_prompt_runs_and_padding_is_exact():
    demo = load_model("demo")
    # prompts of different lengths in one batch (right padding)
    data = Dataset("mixed", tuple(list(es.tasks.ioi(n=3, seed=1)) + list(es.tasks.facts(n=3, seed=1))))
    assert len({len(adapt(demo).tokenize(e.prompt)) for e in data}) > 1
    op = es.Lens(sites=es.Sites(activation="resid_mid", over=["layer", "position"], positions=[-1, -2]), batch_size=8)
    together = op.run(demo, data, quiet=True)
    singles = [op.run(demo, data[i:i + 1], quiet=True) for i in range(len(data))]
    for i, single in enumerate(singles):
        mine = together.per_prompt[together.per_prompt.example == i].sort_values("site").reset_index(drop=True)
        alone = single.per_prompt.sort_values("site").reset_index(drop=True)
        for col in ("target_logit", "target_prob", "kl_to_final", "top1_prob"):
            torch.testing.assert_close(torch.tensor(mine[col].to_numpy()), torch.tensor(alone[col].to_numpy()),
                                       atol=2e-5, rtol=1e-5)
        assert list(mine.top1_token) == list(alone.top1_token)
    # the dataset table is the mean of the single-prompt values
    for col in ("target_prob", "kl_to_final"):
        agg = "target_prob_mean" if col == "target_prob" else "kl_mean"
        sites = list(together.table.site)
        expected = torch.tensor([s.table.set_index("site")[agg].loc[sites].to_numpy() for s in singles]).mean(0)
        torch.testing.assert_close(torch.tensor(together.table[agg].to_numpy()), expected.double(),
                                   atol=1e-6, rtol=1e-6)


def test_component_lens_with_final_scale_is_linear_over_heads():
    demo = load_model("demo")
    data = _ioi(2)
    heads = es.Lens(sites=es.Sites(activation="result", layers=[1], over=["layer", "head"]),
                    component_scale="final").run(demo, data, quiet=True)
    grouped = es.Lens(sites=es.Sites(activation="result", groups=[[{"layer": 1, "head": h} for h in range(4)]]),
                      component_scale="final").run(demo, data, quiet=True)
    attn = es.Lens(sites=es.Sites(activation="attn_out", layers=[1], over=["layer"]),
                   component_scale="final").run(demo, data, quiet=True)
    # logits of the sum of heads = sum of the heads' logits (scale frozen); attn_out adds b_O's share
    per_head = heads.per_prompt.groupby("example").target_logit.sum()
    group = grouped.per_prompt.set_index("example").target_logit
    torch.testing.assert_close(torch.tensor(per_head.to_numpy()), torch.tensor(group.to_numpy()), atol=1e-4, rtol=1e-5)
    a = adapt(demo)
    w = a.weights
    for i, ex in enumerate(data):
        out = a.run(torch.tensor([a.tokenize(ex.prompt)]), ["final_scale"])
        b_O_logit = (w.final_norm.linear_part(w.b_O(1), out["final_scale"][0, -1]) @ w.W_U)[a.token_id(ex.answers[0])]
        total = attn.per_prompt.set_index("example").target_logit[i]
        assert abs(total - group[i] - float(b_O_logit)) < 1e-4


def test_parameter_lens_equals_direct_matmul():
    demo = load_model("demo")
    a = adapt(demo)
    r = es.ParameterLens(target="neuron_out", layers=[2], neurons=[0, 5], top_k=3).run(demo)
    scores = r.extra["scores"]
    torch.testing.assert_close(scores[1], a.weights.W_out(2)[5] @ a.weights.W_U)
    assert r.table.top1_score[1] == pytest.approx(float((a.weights.W_out(2)[5] @ a.weights.W_U).max()), rel=1e-6)
    ov = es.ParameterLens(target="ov", layers=[1], heads=[3], tokens=[" Mary"], space="embed").run(demo)
    t = a.token_id(" Mary")
    expected = a.weights.W_E[t] @ a.weights.W_V(1)[3] @ a.weights.W_O(1)[3] @ a.weights.W_E.T
    torch.testing.assert_close(ov.extra["scores"][0], expected, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_agree_on_plain_weights_and_separate_when_folded():
    plain = load_model("demo")
    folded = load_model("demo", compat=True)
    assert adapt(plain).structure.tied_embeddings
    kw = dict(target="neuron_out", layers=[0], neurons=[3])
    u = es.ParameterLens(space="unembed", **kw).run(plain).extra["scores"]
    e = es.ParameterLens(space="embed", **kw).run(plain).extra["scores"]
    assert torch.equal(u, e)  # HuggingFace's GPT-2 ties W_U = W_E^T exactly
    uf = es.ParameterLens(space="unembed", **kw).run(folded).extra["scores"]
    ef = es.ParameterLens(space="embed", **kw).run(folded).extra["scores"]
    assert (uf - ef).abs().max() > 1e-3  # folding the final norm into W_U and centring separate them


def test_tuned_lens_beats_logit_lens_on_held_out_prompts(tmp_path):
    torch.manual_seed(0)
    demo = load_model("demo")
    mix = lambda seed, n: Dataset("mix", tuple(  # noqa: E731
        e for task in ("ioi", "facts", "greater_than", "induction") for e in es.tasks.get(task, n=n, seed=seed)))
    lens = TunedLens.for_model(demo)
    lens.fit(demo, mix(seed=11, n=48), steps=250, lr=3e-3, quiet=True)
    lens.save(tmp_path / "lens")
    held_out = mix(seed=99, n=8)
    sites = es.Sites(activation="resid_post", over=["layer", "position"])
    logit = es.Lens(sites=sites).run(demo, held_out, quiet=True).per_prompt.groupby("layer").kl_to_final.mean()
    tuned = es.Lens(method="tuned", translators=str(tmp_path / "lens"), sites=sites).run(
        demo, held_out, quiet=True).per_prompt.groupby("layer").kl_to_final.mean()
    last = adapt(demo).structure.n_layers - 1
    for layer in range(last):
        assert tuned[layer] < logit[layer], (layer, tuned[layer], logit[layer])
    assert tuned[last] == pytest.approx(logit[last], abs=1e-6)  # no translator on the output


def test_tuned_lens_loads_the_tuned_lens_package_format(tmp_path):
    """tuned-lens saves layer_translators.state_dict() with torch.save as params.pt + config.json."""
    import json

    n, d = 3, 128
    state = {}
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        state[f"{i}.weight"] = torch.randn(d, d, generator=g) * 0.01
        state[f"{i}.bias"] = torch.randn(d, generator=g) * 0.01
    torch.save(state, tmp_path / "params.pt")
    (tmp_path / "config.json").write_text(json.dumps({"base_model_name_or_path": "demo", "d_model": d,
                                                      "num_hidden_layers": n, "bias": True}))
    lens = TunedLens.load(tmp_path)
    h = torch.randn(5, d, generator=g)
    torch.testing.assert_close(lens.transform(h, 1), h + h @ state["1.weight"].T + state["1.bias"])


def test_parameter_lens_takeaway_quotes_the_units_of_largest_top_score_computed_here():
    """The takeaway's units are the three of largest max_t (v @ W_U)[t], found here by brute force over the
    weights, each with its top and bottom token; no interval is claimed (weights only)."""
    demo = load_model("demo")
    a = adapt(demo)
    r = es.ParameterLens(target="neuron_out", layers=[1, 2], neurons="0:6", top_k=2).run(demo, quiet=True)
    best = sorted(((float((a.weights.W_out(L)[n] @ a.weights.W_U).max()), L, n) for L in (1, 2) for n in range(6)),
                  reverse=True)[:3]
    text = r.takeaway
    quoted = [c for c in text.claims if c.type == "quote" and c.column == "top1_score"]
    assert [(int(c.row["layer"]), int(c.row["neuron"])) for c in quoted] == [(L, n) for _, L, n in best]
    vocab = a.vocab_strings()
    for (score, L, n), c in zip(best, quoted):
        assert c.value == pytest.approx(score, rel=1e-6) and c.low is None
        top = int((a.weights.W_out(L)[n] @ a.weights.W_U).argmax())
        assert f"m{L}.n{n}: {score:.3g} for {vocab[top]!r}" in text
    assert "no interval" in text


def test_target_top1_interval_is_the_wilson_interval_of_the_prompts_counted_from_the_per_prompt_table():
    """target_top1 is a share of prompts: its share is counted here from the per-prompt ranks and its
    interval is the Wilson formula written out here (a bootstrap reads [1, 1] at n of n)."""
    result = es.Lens().run(es.load_model("demo"), es.tasks.ioi(n=8, seed=5), quiet=True)
    pp = result.per_prompt
    seen_full = False
    for _, row in result.table.iterrows():
        ranks = pp[pp["site"] == row.site]["target_rank"].to_numpy()
        n, k = len(ranks), int((ranks == 0).sum())
        assert row.target_top1 == pytest.approx(k / n) and row.n_prompts == n
        low, high = wilson_by_hand(k, n)
        assert row.target_top1_ci_low == pytest.approx(low, abs=1e-12)
        assert row.target_top1_ci_high == pytest.approx(high, abs=1e-12)
        seen_full |= k == n
    assert seen_full  # a site where every prompt's answer is the top token: [n / (n + z^2), 1], not [1, 1]


def test_a_position_selection_without_a_position_axis_is_the_position_decoded():
    """Issue 37: over=[layer], positions=[-2] decoded the last token and labelled it END; it decodes each
    prompt's second-to-last token (TransformerLens's accumulated_resid there), and several positions
    without a position axis are refused."""
    demo = load_model("demo")
    data, a = _ioi(3), adapt(demo)
    pp = es.Lens(sites=es.Sites(activation="resid_pre", over=["layer"], positions=[-2])).run(
        demo, data, quiet=True).per_prompt
    assert set(pp.position) == {"END-1"}
    for i, ex in enumerate(data):
        tokens = demo.to_tokens(ex.prompt, prepend_bos=True)
        _, cache = demo.run_with_cache(tokens)
        acc = cache.accumulated_resid(layer=-1, incl_mid=False, apply_ln=True)
        expected = (acc[:, 0, -2] @ demo.W_U + demo.b_U)[: a.structure.n_layers, a.token_id(ex.answers[0])]
        rows = pp[pp.example == i].sort_values("layer")
        assert rows.token_position.tolist() == [tokens.shape[1] - 2] * a.structure.n_layers
        torch.testing.assert_close(torch.tensor(rows.target_logit.to_numpy(), dtype=torch.float32),
                                   expected.float(), atol=2e-4, rtol=1e-4)
    with pytest.raises(es.errors.SiteError) as err:
        es.Lens(sites=es.Sites(activation="attn_out", over=["layer"], positions=[-2, -1])).run(demo, data, quiet=True)
    assert err.value.code == "bad_selection"
