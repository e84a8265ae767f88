"""Operations on dictionary features: probing, DLA per feature, the decoder lens, the attribution graph, pages.

Each number is checked against something computed here by hand from TransformerLens's own run_with_cache /
run_with_hooks and the dictionary's weights: probes fit on `dictionary.encode(activation)`, DLA rows built
from the cached final-norm scale, W_dec rows times W_U, finite differences of hand-written hooks."""

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.dictionaries import get_dictionary
from entoscope.dictionaries.dla import FeatureDLA
from entoscope.dictionaries.lens import DecoderLens
from entoscope.errors import ConfigError
from entoscope.models.adapter import adapt
from wilson_by_hand import wilson_by_hand
from entoscope.probing import fit_probes


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def last_cache(model, prompt):
    a = adapt(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([a.tokenize(prompt)]))
    return cache


# ---------------------------------------------------------------------- probing on features
def test_probing_feature_sites_equals_a_probe_fit_on_encoded_activations(demo):
    data = es.tasks.ioi(n=48, seed=5)
    sites = es.Sites(activation="resid_post", dictionary="demo", over=["layer"])
    result = es.Probing(sites=sites, C_grid=[0.01, 1.0], seed=3).run(demo, data, quiet=True)
    X = torch.zeros(3, len(data), 512)
    for i, e in enumerate(data):
        cache = last_cache(demo, e.prompt)
        for L in range(3):
            X[L, i] = get_dictionary(f"demo/resid_post.{L}").encode(cache[f"blocks.{L}.hook_resid_post"][0, -1])
    ref = fit_probes(X, [e.label for e in data], C_grid=[0.01, 1.0], seed=3).to_frame()
    for col in ("test_accuracy", "control_test_accuracy", "train_accuracy", "C"):
        np.testing.assert_allclose(result.table[col].to_numpy(dtype=float), ref[col].to_numpy(dtype=float),
                                   atol=1e-6, err_msg=col)
    assert list(result.table["layer"]) == [0, 1, 2]


def test_probing_single_features_reads_one_column_and_ablates_it(demo):
    data = es.tasks.ioi(n=32, seed=6)
    feats = [3, 40]
    sites = es.Sites(activation="mlp_out", dictionary="demo/transcoder.1", over=["feature"], features=feats)
    result = es.Probing(sites=sites, split="kfold", k=4,
                        causal_check={"metric": "logit_diff", "top": 1}).run(demo, data, quiet=True)
    X = torch.zeros(2, len(data), 1)
    d = get_dictionary("demo/transcoder.1")
    for i, e in enumerate(data):
        f = d.encode(last_cache(demo, e.prompt)["blocks.1.ln2.hook_out"][0, -1])
        X[:, i, 0] = f[feats]
    ref = fit_probes(X, [e.label for e in data], split="kfold", k=4).to_frame()
    np.testing.assert_allclose(result.table["test_accuracy"].to_numpy(dtype=float),
                               ref["test_accuracy"].to_numpy(dtype=float), atol=1e-6)
    # the causal check removes the probe's direction: for one feature, that zeroes it at the last token,
    # i.e. mlp_out.1 -= f_i W_dec[i] there (the error term kept), written here as a hook
    pp = result.extra["causal_per_prompt"]
    site = result.table.dropna(subset=["metric_change"])["site"].iloc[0]
    i = feats[list(result.table["site"]).index(site)]
    a = adapt(demo)
    ablated = []
    for e in data:
        tokens = torch.tensor([a.tokenize(e.prompt)])
        stash = {}

        def keep(x, hook, stash=stash):
            stash["f"] = d.encode(x)

        def zero(x, hook, stash=stash):
            x = x.clone()
            x[0, -1] -= stash["f"][0, -1, i] * d.W_dec[i]
            return x
        with torch.no_grad():
            out = demo.run_with_hooks(tokens, fwd_hooks=[("blocks.1.ln2.hook_out", keep), ("blocks.1.hook_mlp_out", zero)])
        ablated.append(float(out[0, -1, a.token_id(e.answers[0])] - out[0, -1, a.token_id(e.wrong_answers[0])]))
    got = pp[pp["site"] == site].sort_values("example")["metric_ablated"].to_numpy() if "site" in pp else \
        pp.sort_values("example")["metric_ablated"].to_numpy()
    np.testing.assert_allclose(got, ablated, atol=2e-4)


# ---------------------------------------------------------------------- DLA per feature
def _u(a, ex):
    W_U = a.weights.W_U.detach().double()
    return W_U[:, [a.token_id(ex.answers[0])]].mean(1) - W_U[:, [a.token_id(w) for w in ex.wrong_answers]].mean(1)


def test_feature_dla_rows_add_up_to_the_logit_difference_and_match_by_hand(demo):
    a = adapt(demo)
    data = es.tasks.ioi(n=4, seed=3)
    result = FeatureDLA(dictionary="demo", activation="mlp_out", top_k_features=512).run(demo, data, quiet=True)
    ident, pp = result.extra["identity"], result.per_prompt
    norm = a.weights.final_norm
    d = get_dictionary("demo/transcoder.1")
    for i, ex in enumerate(data):
        cache = last_cache(demo, ex.prompt)
        with torch.no_grad():
            logits = demo(torch.tensor([a.tokenize(ex.prompt)]), return_type="logits")[0, -1].double()
        value = logits[a.token_id(ex.answers[0])] - logits[a.token_id(ex.wrong_answers[0])]
        rows = pp[pp["example"] == i]
        assert rows["contribution"].sum() + ident["constant"][i] == pytest.approx(float(value), abs=1e-4)
        # one feature of transcoder 1 by hand: f_i W_dec[i], centred, over the cached final scale, times w, onto u
        f = d.encode(cache["blocks.1.ln2.hook_out"][0, -1]).double()
        scale = cache["ln_final.hook_scale"][0, -1, 0].double()
        u = _u(a, ex)
        i_feat = int(f.argmax())
        vec = f[i_feat] * d.W_dec[i_feat].double()
        vec = (vec - vec.mean()) / scale * norm.weight.detach().double()
        row = rows[(rows["dictionary"] == "demo/transcoder.1") & (rows["feature"] == i_feat)]
        assert float(row["contribution"].iloc[0]) == pytest.approx(float(vec @ u), abs=1e-6)
        # the error row: mlp_out minus the reconstruction, through the same frozen norm
        err = cache["blocks.1.hook_mlp_out"][0, -1].double() - d.decode(f.float()).double()
        err = (err - err.mean()) / scale * norm.weight.detach().double()
        row = rows[rows["component"] == "demo/transcoder.1 error"]
        assert float(row["contribution"].iloc[0]) == pytest.approx(float(err @ u), abs=1e-5)
    # the MLPs are replaced: no m{L} rows, the heads are DLA's own
    plain = es.DirectLogitAttribution().run(demo, data, quiet=True).per_prompt
    assert not set(pp["component"]) & {"m0", "m1", "m2"}
    np.testing.assert_allclose(pp[pp["component"] == "a2.h1"]["contribution"].to_numpy(),
                               plain[plain["component"] == "a2.h1"]["contribution"].to_numpy(), atol=1e-9)


def test_feature_dla_on_a_resid_sae_keeps_later_components_and_top_k_rows_add_up(demo):
    data = es.tasks.ioi(n=6, seed=4)
    result = FeatureDLA(dictionary="demo", activation="resid_post", layers=1, top_k_features=5).run(
        demo, data, quiet=True)
    pp, ident = result.per_prompt, result.extra["identity"]
    assert set(pp["component"]) >= {"a2.h0", "m2", "demo/resid_post.1 error", "demo/resid_post.1 other features"}
    assert not set(pp["component"]) & {"embed", "a1.h0", "m1", "a0.h2"}
    per_example = pp.groupby("example")["contribution"].sum().to_numpy() + ident["constant"].to_numpy()
    np.testing.assert_allclose(per_example, ident["value"].to_numpy(), atol=1e-4)
    assert (pp[pp["kind"] == "feature"].groupby("example").size() == 5).all()
    with pytest.raises(ConfigError) as err:
        FeatureDLA(dictionary="demo", activation="resid_post").plan(demo, data)
    assert err.value.code == "feature_dla_layers"


# ---------------------------------------------------------------------- decoder lens
@pytest.mark.parametrize("through_norm", [True, False])
def test_decoder_lens_is_the_decoder_row_times_W_U(demo, through_norm):
    a = adapt(demo)
    feats = [2, 7, 300]
    table = DecoderLens(dictionary="demo/transcoder.1", features=feats, top_k=4,
                        through_norm=through_norm).run(demo, quiet=True).table
    W_dec = get_dictionary("demo/transcoder.1").W_dec.double()
    W_U = demo.unembed.W_U.detach().double() if hasattr(demo, "unembed") else a.weights.W_U.double()
    w = a.weights.final_norm.weight.detach().double()
    vocab = a.vocab_strings()
    for j, i in enumerate(feats):
        v = W_dec[i]
        if through_norm:
            v = (v - v.mean()) * w
        scores = v @ W_U
        top = scores.topk(4)
        assert list(table.loc[j, [f"top{t}_token" for t in range(1, 5)]]) == [vocab[t] for t in top.indices.tolist()]
        np.testing.assert_allclose(table.loc[j, [f"top{t}_score" for t in range(1, 5)]].to_numpy(dtype=float),
                                   top.values.numpy(), rtol=1e-5)
        assert table.loc[j, "bottom1_score"] == pytest.approx(float(scores.min()), rel=1e-5)


# ---------------------------------------------------------------------- attribution graph
def _graph(demo, data, **kw):
    from entoscope.dictionaries.graph import FeatureGraph

    return FeatureGraph(**kw).run(demo, data, quiet=True)


def _bump_hook(vec, p, eps):
    def hook(x, hook):
        x = x.clone()
        x[0, p] += eps * vec
        return x
    return hook


def test_graph_edges_equal_finite_differences_of_hand_written_hooks(demo):
    """resid_post SAEs at layers 0 and 1, zero baseline: A[t, u] = f_u * d t / d f_u. Moving feature u of
    resid_post.0 by eps moves resid_post.0 by eps W_dec[u]; the target is the layer-1 SAE's encoding of
    resid_post.1 (direct: nothing between the two sites is a node), and the metric for a layer-1 source."""
    a = adapt(demo)
    data = es.tasks.ioi(n=2, seed=9)
    result = _graph(demo, data, layers=[0, 1], baseline="zero", max_features=24)
    d0, d1 = get_dictionary("demo/resid_post.0"), get_dictionary("demo/resid_post.1")
    eps = 0.05
    for e, ex in enumerate(data):
        g = result.extra["graphs"][e]
        nodes, A = g.nodes, g.adjacency
        tokens = torch.tensor([a.tokenize(ex.prompt)])
        io, s = a.token_id(ex.answers[0]), a.token_id(ex.wrong_answers[0])
        feats = nodes[nodes["kind"] == "feature"]
        src0, tgt1 = feats[feats["layer"] == 0], feats[feats["layer"] == 1]
        # the strongest layer-0 -> layer-1 edge of this prompt
        block = A[np.ix_(tgt1.index, src0.index)].abs()
        r, c = divmod(int(block.argmax()), block.shape[1])
        t, u = tgt1.iloc[r], src0.iloc[c]

        def target(eps_, u=u, t=t, tokens=tokens):
            out = {}
            with torch.no_grad():

                def read(x, hook, out=out):
                    out["f"] = d1.encode(x)[0, t["position"], t["feature"]].double()
                demo.run_with_hooks(tokens, fwd_hooks=[
                    ("blocks.0.hook_resid_post", _bump_hook(d0.W_dec[u["feature"]], u["position"], eps_)),
                    ("blocks.1.hook_resid_post", read)])
            return out["f"]
        fd = (target(eps) - target(-eps)) / (2 * eps) * u["value"]
        assert float(A[t.name, u.name]) == pytest.approx(float(fd), rel=2e-2, abs=2e-3)
        # a layer-1 source's edge into the metric: the logit difference moved by resid_post.1 += eps W_dec[i]
        w = tgt1.iloc[int(A[nodes.index[-1], tgt1.index].abs().argmax())]

        def metric(eps_, w=w, tokens=tokens, io=io, s=s):
            with torch.no_grad():
                logits = demo.run_with_hooks(tokens, fwd_hooks=[
                    ("blocks.1.hook_resid_post", _bump_hook(d1.W_dec[w["feature"]], w["position"], eps_))])[0, -1]
            return (logits[io] - logits[s]).double()
        fd = (metric(eps) - metric(-eps)) / (2 * eps) * w["value"]
        assert float(A[nodes.index[-1], w.name]) == pytest.approx(float(fd), rel=2e-2, abs=2e-3)
        # at the last site the direct edge into the metric is the total effect (attribution patching)
        assert float(A[nodes.index[-1], w.name]) == pytest.approx(w["attribution"], rel=1e-4, abs=1e-6)


def test_graph_ig_incoming_edges_add_up_to_each_targets_change(demo):
    """EAP-IG with the counterfactual baseline: for each target, the sum of its incoming edges from every
    source tends to its value on the prompt minus its value on the counterfactual (completeness)."""
    a = adapt(demo)
    data = es.tasks.ioi(n=2, seed=4)
    result = _graph(demo, data, activation="mlp_out", method="eap_ig", steps=16, max_features=12)
    for e, ex in enumerate(data):
        nodes = result.extra["graphs"][e].nodes
        feats = nodes[nodes["kind"] == "feature"]
        np.testing.assert_allclose(feats["incoming_sum"], feats["target_change"], rtol=0.03,
                                   atol=0.02 * float(feats["target_change"].abs().max()))
        with torch.no_grad():
            clean = demo(torch.tensor([a.tokenize(ex.prompt)]))[0, -1]
            corrupt = demo(torch.tensor([a.tokenize(ex.counterfactual)]))[0, -1]
        io, s = a.token_id(ex.answers[0]), a.token_id(ex.wrong_answers[0])
        change = float((clean[io] - clean[s]) - (corrupt[io] - corrupt[s]))
        assert float(nodes["incoming_sum"].iloc[-1]) == pytest.approx(change, rel=0.03, abs=0.05)


def test_graph_scores_on_a_hand_computed_graph():
    from entoscope.dictionaries.graph import graph_scores

    # nodes: feature, error, token, metric; token -> feature (2), feature -> metric (3), error -> metric (-1)
    A = torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [3.0, -1.0, 0, 0]])
    s = graph_scores(A, np.array(["feature", "error", "token", "metric"]))
    # normalised: metric row (0.75, 0.25); influence: feature 0.75, error 0.25, token 0.75 (via the feature)
    assert s["replacement"] == pytest.approx(0.75 / (0.75 + 0.25))
    # completeness: only the metric has an error share (0.25); weights influence + output = (.75, .25, .75, 1)
    assert s["completeness"] == pytest.approx((0.75 + 0.25 + 0.75 + 0.75) / 2.75)


def test_dataset_graph_sums_positions_and_averages_prompts(demo):
    result = _graph(demo, es.tasks.ioi(n=3, seed=2), max_features=16)
    graphs, whole = result.extra["graphs"], result.extra["dataset"]
    metric_row = whole.adjacency[-1]
    by_node = dict(zip(whole.nodes["node"], metric_row.tolist()))
    # the dataset edge from each dictionary's error node into the metric: mean over prompts of the sum over positions
    for key in ("demo/resid_post.2",):
        expect = np.mean([float(g.adjacency[-1, (g.nodes["kind"] == "error").to_numpy() &
                                            (g.nodes["dictionary"] == key).to_numpy()].sum()) for g in graphs])
        assert by_node["resid_post.2.error"] == pytest.approx(expect, rel=1e-9, abs=1e-12)  # the site's name
    assert set(result.extra["scores"]["example"]) == {0, 1, 2}
    assert 0 <= result.extra["dataset_scores"]["replacement"] <= 1


# ---------------------------------------------------------------------- feature pages and the report section
def test_feature_pages_show_the_top_examples_with_hand_encoded_activations(demo, tmp_path):
    import html
    import re

    from entoscope.dictionaries.pages import page_name, write_feature_pages

    data = es.tasks.induction(n=10, seed=3)
    d = get_dictionary("demo/resid_post.1")
    acts = []
    for e in data:
        acts.append(d.encode(last_cache(demo, e.prompt)["blocks.1.hook_resid_post"][0]).numpy())
    i = int((np.concatenate([x[1:] for x in acts]) != 0).sum(0).argmax())  # the feature active most often
    pages = write_feature_pages(demo, [("demo/resid_post.1", i)], data, tmp_path, top_examples=3)
    text = pages[("demo/resid_post.1", i)].read_text()
    assert pages[("demo/resid_post.1", i)].name == page_name("demo/resid_post.1", i)
    best = np.array([x[1:, i].max() for x in acts])
    order = np.argsort(-best, kind="stable")[:3]
    shown = [int(p) for p in re.findall(r"prompt (\d+): max", text)]
    assert shown == [int(e) for e in order if best[e] > 0]
    # the shaded tokens of the first example carry the feature's activation at each position
    first = text.split("prompt ")[1]
    values = [float(v) for v in re.findall(r'title="([-0-9.e+]+)"', first.split("</div>")[0])]
    np.testing.assert_allclose(values, acts[order[0]][:, i], rtol=2e-3, atol=1e-3)
    share = float(np.mean(np.concatenate([x[1:, i] for x in acts]) != 0))
    assert f"active on {share:.1%} of tokens" in text
    top1 = DecoderLens(dictionary="demo/resid_post.1", features=[i], top_k=1).run(demo, quiet=True).table
    assert f">{html.escape(str(top1.loc[0, 'top1_token']))}</td>" in text  # a table cell holds it
    assert (tmp_path / "index.html").exists() and (tmp_path / "plotly.min.js").exists()


def test_report_features_section_lists_the_strongest_features_with_pages(demo, tmp_path):
    import re

    import pandas as pd

    from entoscope.report.sections.features import features_section

    folder = tmp_path / "features"
    section = features_section(demo, folder, quick=True)
    title, body = section.title, section.body
    assert "IOI" in title and "induction" in title
    for link in re.findall(r'href="([^"]+)"', body):
        assert (tmp_path / link).exists(), link
    table = pd.read_csv(folder / "table.csv")  # the IOI patching result, saved by the section
    top = table.reindex(table["value"].abs().sort_values(ascending=False).index).iloc[0]
    assert top["site"].split("@")[0] in body  # named as its table names it: resid_post.1.f29
    assert top["value_ci_low"] <= top["value"] <= top["value_ci_high"]


def test_report_features_section_says_so_on_a_model_without_dictionaries(tmp_path):
    from conftest import get_tiny

    from entoscope.report.sections.features import features_section

    body = features_section(get_tiny("gpt2", "bridge", False), tmp_path / "features", quick=True).body
    assert "No dictionaries fit" in body and (tmp_path / "features" / "index.html").exists()


def test_feature_dla_takeaway_says_first_whether_any_row_passes_the_fdr_and_ranks_features_by_abs_mean(demo):
    """Counted here from the table: when no row is significant the takeaway opens by saying so; the features
    it quotes are the feature rows of largest |mean| (sorted here), each with its interval and q."""
    result = FeatureDLA(dictionary="demo", activation="mlp_out", top_k_features=4).run(
        demo, es.tasks.ioi(n=8, seed=2), quiet=True)
    t, text = result.table, result.takeaway
    n_sig = int(t["significant"].sum())
    if n_sig == 0:
        assert text.startswith("No row survives the false discovery screen") and f"0 of {len(t)} rows" in text
    else:
        assert text.startswith(f"{n_sig} of {len(t)} rows")
    feats = t[t["kind"] == "feature"]
    top = feats.loc[feats["mean"].abs().sort_values(ascending=False, kind="stable").index[:3]]
    quoted = [c for c in text.claims if c.type == "quote" and c.row["component"] in set(feats["component"])]
    assert [c.row["component"] for c in quoted] == list(top["component"])
    for c, (_, row) in zip(quoted, top.iterrows()):
        assert c.low == pytest.approx(row["mean_ci_low"]) and c.q == pytest.approx(row["mean_q"])
        assert f"{row['component']} {row['mean']:+.3f} [{row['mean_ci_low']:+.3f}, {row['mean_ci_high']:+.3f}]" in text


def test_feature_dla_active_share_interval_is_the_wilson_interval_of_the_prompts_counted_here(demo):
    """A feature's active_share is a share of prompts: counted here from the per-prompt rows (every feature
    of each dictionary kept, so a feature is active in a prompt where its contribution is not 0), and its
    interval is the Wilson formula written out here; a component row is active by definition: [1, 1]."""
    data = es.tasks.ioi(n=6, seed=3)
    result = FeatureDLA(dictionary="demo", activation="mlp_out", top_k_features=512).run(demo, data, quiet=True)
    t, pp = result.table, result.per_prompt
    features = pp[pp["kind"] == "feature"]
    per_prompt_counts = features.groupby("example").size()
    assert (per_prompt_counts == per_prompt_counts.iloc[0]).all()  # every feature kept in every prompt
    n = len(data)
    active = features.assign(on=features["contribution"] != 0).groupby("component")["on"].sum()
    rows = t[t["kind"] == "feature"]
    assert len(rows) and (rows["active_share"] < 1).any()
    for _, row in rows.iterrows():
        k = int(active[row.component])
        assert row.active_share == pytest.approx(k / n)
        low, high = wilson_by_hand(k, n)
        assert row.active_share_ci_low == pytest.approx(low, abs=1e-12)
        assert row.active_share_ci_high == pytest.approx(high, abs=1e-12)
    comp = t[t["kind"] == "head"].iloc[0]
    assert comp.active_share == comp.active_share_ci_low == comp.active_share_ci_high == 1.0


def test_feature_dla_identity_csv_has_the_decoder_bias_and_its_columns_add_up_to_the_logit_difference(demo, tmp_path):
    """Issue 37: identity.csv lacked the decoder_bias column docs/features.md lists. Per prompt, from the saved
    file: sum_of_rows + decoder_bias + (the final norm's bias and b_U along u, by hand) = the logit difference
    read from the model's logits; decoder_bias = b_dec through the frozen final norm, by hand."""
    import pandas as pd

    a = adapt(demo)
    data = es.tasks.ioi(n=4, seed=8)
    FeatureDLA(dictionary="demo", activation="mlp_out", top_k_features=8).run(demo, data, quiet=True).save(
        tmp_path / "run")
    ident = pd.read_csv(tmp_path / "run" / "identity.csv")
    assert "decoder_bias" in ident.columns
    norm = a.weights.final_norm
    w, b = norm.weight.detach().double(), norm.bias.detach().double()
    b_U = a.weights.b_U.detach().double()
    for i, ex in enumerate(data):
        cache = last_cache(demo, ex.prompt)
        with torch.no_grad():
            logits = demo(torch.tensor([a.tokenize(ex.prompt)]), return_type="logits")[0, -1].double()
        ans, wrong = a.token_id(ex.answers[0]), a.token_id(ex.wrong_answers[0])
        value = float(logits[ans] - logits[wrong])
        u, scale = _u(a, ex), cache["ln_final.hook_scale"][0, -1, 0].double()
        bias = 0.0
        for L in range(a.structure.n_layers):  # the demo release: one transcoder per layer's MLP
            b_dec = get_dictionary(f"demo/transcoder.{L}").b_dec.double()
            bias += float(((b_dec - b_dec.mean()) / scale * w) @ u)
        rest = float(b @ u + b_U[ans] - b_U[wrong])  # DLA's own constant: the final norm's bias and b_U
        assert ident["decoder_bias"][i] == pytest.approx(bias, abs=1e-5)
        assert ident["sum_of_rows"][i] + ident["decoder_bias"][i] + rest == pytest.approx(value, abs=1e-4)
        assert ident["value"][i] == pytest.approx(value, abs=1e-4)
