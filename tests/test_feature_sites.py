"""Feature sites: a dictionary's features read (encode) and written (decode + error term) in a model run.

Checked against TransformerLens's own run_with_cache / run_with_hooks with hooks written here that
encode, edit and decode by hand, and against the identity decode(encode(x)) + error = x."""

import pytest
import torch

import entoscope as es
from entoscope.dictionaries import Dictionary, get_dictionary, register_dictionary, release_members
from entoscope.errors import DictionaryError, SiteError
from entoscope.models.adapter import adapt
from entoscope.models.names import ActName, parse_name
from entoscope.patching.values import patch_value
from tests.conftest import needs_hooked

HOOKS = {"resid_post": "blocks.{L}.hook_resid_post", "mlp_in": "blocks.{L}.ln2.hook_out",
         "mlp_out": "blocks.{L}.hook_mlp_out"}  # the bridge's hook names


def tl_hook(name: str) -> str:
    act = parse_name(name)
    return HOOKS[act.kind].format(L=act.layer)


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def same_length_ioi(model, n: int) -> es.Dataset:
    """IOI examples whose prompts all have one token length (so hand-written runs batch without padding)."""
    m = adapt(model)
    pool = es.tasks.ioi(n=8 * n)
    lengths = [len(m.tokenize(e.prompt)) for e in pool]
    common = max(set(lengths), key=lengths.count)
    return es.Dataset("ioi_same_length", tuple([e for e, L in zip(pool, lengths) if L == common][:n]))


@pytest.fixture(scope="module")
def ioi_tokens(demo):
    m = adapt(demo)
    data = same_length_ioi(demo, 6)
    clean = torch.tensor([m.tokenize(e.prompt) for e in data])
    corrupt = torch.tensor([m.tokenize(e.counterfactual) for e in data])
    answers = torch.tensor([m.token_id(e.answers[0]) for e in data])
    wrong = torch.tensor([m.token_id(e.wrong_answers[0]) for e in data])
    return data, clean, corrupt, answers, wrong


def test_demo_release_has_an_sae_per_layer_and_transcoders():
    members = release_members("demo")
    assert {f"resid_post.{L}" for L in range(3)} | {f"transcoder.{L}" for L in range(3)} <= set(members)
    tc = get_dictionary("demo/transcoder.1")
    assert (tc.hook_in, tc.hook_out, tc.space) == ("mlp_in.1", "mlp_out.1", "plain")


@pytest.mark.parametrize("member", ["resid_post.0", "resid_post.1", "resid_post.2", "transcoder.1"])
def test_reconstruction_plus_error_is_the_activation(demo, ioi_tokens, member):
    _, clean, *_ = ioi_tokens
    d = get_dictionary(f"demo/{member}")
    _, cache = demo.run_with_cache(clean)
    x_in, x_out = cache[tl_hook(d.hook_in)], cache[tl_hook(d.hook_out)]
    recon = d.decode(d.encode(x_in))
    torch.testing.assert_close(recon + d.error(x_in, x_out), x_out, rtol=0, atol=1e-5 * float(x_out.abs().max()))
    key = f"demo/{member}"
    out = adapt(demo).run(clean, [ActName("features", parse_name(d.hook_out).layer, key)], logits=False)
    assert torch.equal(out.acts[ActName("features", parse_name(d.hook_out).layer, key)], d.encode(x_in))


@pytest.mark.parametrize("member", ["resid_post.0", "resid_post.1", "resid_post.2", "transcoder.0", "transcoder.2"])
def test_unpatched_feature_sites_leave_the_model_exact(demo, ioi_tokens, member):
    _, clean, *_ = ioi_tokens
    d = get_dictionary(f"demo/{member}")
    act = ActName("features", parse_name(d.hook_out).layer, f"demo/{member}")
    plain = demo(clean, return_type="logits")
    run = adapt(demo).run(clean, interventions=[es.Intervention(act, lambda f: f.clone())])
    assert torch.equal(run.logits, plain)


@needs_hooked
def test_unpatched_feature_sites_are_exact_on_a_hooked_transformer():
    from entoscope.models.tiny import tiny_model

    model = tiny_model("gpt2", "hooked", False)
    m = adapt(model)
    s = m.structure
    g = torch.Generator().manual_seed(0)
    sae = Dictionary("topk", torch.randn(s.d_model, 48, generator=g), torch.randn(48, s.d_model, generator=g),
                     torch.randn(s.d_model, generator=g), "resid_mid.1", "resid_mid.1", b_enc=torch.randn(48, generator=g),
                     k=6, space="any")
    tc = Dictionary("standard", torch.randn(s.d_model, 40, generator=g), torch.randn(40, s.d_model, generator=g),
                    torch.randn(s.d_model, generator=g), "mlp_in.0", "mlp_out.0", b_enc=torch.randn(40, generator=g),
                    space="any")
    register_dictionary("test_hooked_sae", sae, replace=True)
    register_dictionary("test_hooked_tc", tc, replace=True)
    tokens = torch.randint(1, s.d_vocab, (3, 9), generator=g)
    plain = model(tokens, return_type="logits")
    ivs = [es.Intervention("features.1@test_hooked_sae", lambda f: f), es.Intervention("features.0@test_hooked_tc", lambda f: f)]
    assert torch.equal(m.run(tokens, interventions=ivs).logits, plain)
    # and a real edit changes the output through the decoder, keeping the error: resid_mid.1 += 2 * W_dec[3]
    def bump(f):
        f = f.clone()
        f[:, :, 3] += 2.0
        return f
    edited = m.run(tokens, interventions=[es.Intervention("features.1@test_hooked_sae", bump)]).logits
    by_hand = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, hook: x + 2.0 * sae.W_dec[3])])
    torch.testing.assert_close(edited, by_hand, rtol=1e-5, atol=1e-5)


def _logit_diff(logits, answers, wrong):
    last = logits[:, -1]
    return last.gather(1, answers[:, None])[:, 0] - last.gather(1, wrong[:, None])[:, 0]


@pytest.mark.parametrize("member, hook_in_fmt", [("resid_post.1", None), ("transcoder.1", "blocks.1.ln2.hook_out")])
def test_feature_patch_equals_a_hand_written_encode_edit_decode_hook(demo, ioi_tokens, member, hook_in_fmt):
    data, clean, corrupt, answers, wrong = ioi_tokens
    d = get_dictionary(f"demo/{member}")
    out_hook = tl_hook(d.hook_out)
    in_hook = tl_hook(d.hook_in)
    _, clean_cache = demo.run_with_cache(clean)
    f_clean = d.encode(clean_cache[in_hook])
    _, corrupt_cache = demo.run_with_cache(corrupt)
    f_corrupt = d.encode(corrupt_cache[in_hook])
    positions = [-1, -3]
    # features that differ between the runs at those positions: the ones patching can move
    moved = (f_clean[:, positions] - f_corrupt[:, positions]).abs().amax(dim=(0, 1))
    feats = moved.argsort(descending=True)[:4].tolist()
    sites = es.Sites(activation=d.hook_out.split(".")[0], dictionary=f"demo/{member}", over=["position", "feature"],
                     positions=positions, features=feats)
    result = es.Patching(method="exact", sites=sites, comparison="difference").run(demo, data, quiet=True)
    patched = result.extra["patched"]  # [E, U], units in order position x feature
    m_base = _logit_diff(demo(corrupt, return_type="logits"), answers, wrong)
    assert torch.allclose(result.extra["m_base"], m_base.double(), atol=1e-5)
    T = clean.shape[1]
    for u, (p, i) in enumerate([(p, i) for p in positions for i in feats]):
        stash = {}

        def keep(x, hook):
            stash["x_in"] = x

        def edit(x, hook, p=p, i=i):
            f = d.encode(stash["x_in"] if hook_in_fmt else x)
            f2 = f.clone()
            f2[:, T + p, i] = f_clean[:, T + p, i]
            return d.decode(f2) + (x - d.decode(f))
        hooks = ([(in_hook, keep)] if hook_in_fmt else []) + [(out_hook, edit)]
        by_hand = _logit_diff(demo.run_with_hooks(corrupt, fwd_hooks=hooks), answers, wrong)
        torch.testing.assert_close(patched[:, u], by_hand.double(), rtol=1e-4, atol=1e-4)
    assert (patched - result.extra["m_base"][:, None]).abs().max() > 1e-3  # something moved


@patch_value("toward_source_test", needs=("base", "source"), params={"eps": 1e-4}, replace=True)
def _toward_source(inputs, eps=1e-4):
    return inputs.base + eps * (inputs.source - inputs.base)


def test_attribution_over_features_is_the_small_change_limit_of_exact_patching():
    """In float64: exact patching of each single feature by eps (source - base), divided by eps, tends to
    attribution's gradient x (source - base) as eps -> 0 (the finite-difference limit)."""
    model = es.load_model("demo", dtype="float64")
    data = same_length_ioi(model, 4)
    m = adapt(model)
    d = get_dictionary("demo/resid_post.1")
    f = {run: d.encode(model.run_with_cache(torch.tensor([m.tokenize(getattr(e, run)) for e in data]))[1][
        "blocks.1.hook_resid_post"]) for run in ("prompt", "counterfactual")}
    moved = (f["prompt"][:, -3:] - f["counterfactual"][:, -3:]).abs().amax(dim=(0, 1))
    feats = moved.argsort(descending=True)[:6].tolist()  # features the pairs move: effects to compare
    sites = es.Sites(activation="resid_post", dictionary="demo/resid_post.1", over=["position", "feature"],
                     positions=[-1, -2, -3], features=feats)
    eps = 1e-4
    cfg = dict(sites=sites, comparison="difference", patch="toward_source_test", patch_params={"eps": eps})
    exact = es.Patching(method="exact", **cfg).run(model, data, quiet=True)
    attribution = es.Patching(method="attribution", **cfg).run(model, data, quiet=True)
    full = es.Patching(method="attribution", sites=sites, comparison="difference").run(model, data, quiet=True)
    d_exact = (exact.extra["patched"] - exact.extra["m_base"][:, None]) / eps
    d_attr = (attribution.extra["patched"] - attribution.extra["m_base"][:, None]) / eps
    d_full = full.extra["patched"] - full.extra["m_base"][:, None]
    scale = float(d_attr.abs().max())
    assert scale > 1e-2
    torch.testing.assert_close(d_exact, d_attr, rtol=0, atol=1e-3 * scale)
    torch.testing.assert_close(d_attr, d_full, rtol=1e-8, atol=1e-10)  # first order: linear in the change


def test_release_resolution_and_refusals(demo):
    m = adapt(demo)
    ss = es.Sites(activation="resid_post", dictionary="demo", over=["layer", "feature"], features=[0, 7]).resolve(m)
    assert ss.bases == tuple((L, f"demo/resid_post.{L}") for L in range(3)) and len(ss) == 6
    assert set(ss.frame()["dictionary"]) == {f"demo/resid_post.{L}" for L in range(3)}
    one = es.Sites(activation="mlp_out", dictionary="demo/transcoder.2", over=["feature"], features="0:5").resolve(m)
    assert one.bases == ((2, "demo/transcoder.2"),) and len(one) == 5
    refusals = [
        (dict(activation="resid_post", layers=0, dictionary="demo/resid_post.1"), "dictionary_site_mismatch"),
        (dict(activation="attn_out", dictionary="demo"), "dictionary_site_mismatch"),
        (dict(activation="features", over=["feature"]), "features_name"),
        (dict(activation="resid_post", dictionary="demo/resid_post.1", over=["feature"], features=[10_000]),
         "site_out_of_range"),
        (dict(activation="resid_post", dictionary="demo/nothing"), "dictionary_not_found"),
    ]
    for kwargs, code in refusals:
        with pytest.raises((SiteError, DictionaryError)) as err:
            es.Sites(**kwargs).resolve(m)
        assert err.value.code == code, kwargs


def test_plan_checks_feature_sites_before_running(demo):
    sites = es.Sites(activation="resid_post", dictionary="demo", over=["layer", "position", "feature"],
                     positions=[-1], features="0:8")
    plan = es.Patching(method="attribution", sites=sites).plan(demo, es.tasks.ioi(n=4))
    assert plan.rows == 3 * 8


@needs_hooked
def test_a_plain_space_dictionary_is_refused_on_processed_activations():
    model = es.load_model("demo", backend="hooked")
    with pytest.raises(DictionaryError) as err:
        es.Sites(activation="resid_post", dictionary="demo/resid_post.1").resolve(adapt(model))
    assert err.value.code == "dictionary_space_mismatch"


def test_integrated_gradients_over_every_feature_sums_to_patching_the_whole_reconstruction(demo, ioi_tokens):
    """Completeness: IG estimates over all features at all positions of one layer add up to the exact
    effect of patching the dictionary's whole reconstruction there (error kept), up to the midpoint
    rule's error, which shrinks with the number of steps."""
    data = ioi_tokens[0]
    every = es.Sites(activation="resid_post", dictionary="demo/resid_post.1", over=["position", "feature"])
    whole = es.Sites(activation="resid_post", dictionary="demo/resid_post.1", over=["layer"])
    exact = es.Patching(method="exact", sites=whole, comparison="difference").run(demo, data, quiet=True)
    total = (exact.extra["patched"] - exact.extra["m_base"][:, None])[:, 0]
    assert float(total.abs().min()) > 0.1  # the reconstruction carries something
    gaps = []
    for steps in (4, 16):
        ig = es.Patching(method="integrated_gradients", sites=every, comparison="difference", ig_steps=steps,
                         per_prompt=False).run(demo, data, quiet=True)
        summed = (ig.extra["patched"] - ig.extra["m_base"][:, None]).sum(1)
        gaps.append(float((summed - total).abs().max()))
    assert gaps[1] < 0.02 * float(total.abs().max()) and gaps[1] < gaps[0]


def test_top_sites_keeps_each_prompts_largest_effects(demo, ioi_tokens):
    from entoscope.patching import top_sites

    data = ioi_tokens[0]
    sites = es.Sites(activation="resid_post", dictionary="demo", over=["layer", "position", "feature"], positions=[-1])
    result = es.Patching(method="attribution", sites=sites, comparison="difference").run(demo, data, quiet=True)
    top = top_sites(result, k=5)
    diff = (result.extra["patched"] - result.extra["m_base"][:, None]).numpy()
    assert len(top) == 5 * len(data)
    for e in range(len(data)):
        expect = sorted(abs(diff[e]), reverse=True)[:5]
        got = top[top["example"] == e]["difference"].abs().tolist()
        assert got == pytest.approx(expect)
    title, fig = result.figures()[0]  # the page shows the strongest feature sites, not a layer x position grid
    mean = diff.mean(0)
    strongest = [result.table["site"][i] for i in sorted(range(len(mean)), key=lambda i: -abs(mean[i]))[:40]]
    assert "feature sites of largest |value|" in title and list(fig.data[0].x) == strongest


@needs_hooked
def test_partial_runs_patch_features_as_full_runs_do():
    """On a HookedTransformer, patched runs start at the feature's layer and position (cached prefix):
    the same numbers as full forwards (prefix_reuse off), for an SAE and a transcoder."""
    from entoscope.models.tiny import tiny_model

    model = tiny_model("gpt2", "hooked", False)
    s = adapt(model).structure
    g = torch.Generator().manual_seed(1)
    register_dictionary("test_partial_sae", Dictionary(
        "jumprelu", torch.randn(s.d_model, 32, generator=g), torch.randn(32, s.d_model, generator=g),
        torch.randn(s.d_model, generator=g), "resid_post.1", "resid_post.1", b_enc=torch.randn(32, generator=g),
        threshold=torch.rand(32, generator=g), space="any"), replace=True)
    register_dictionary("test_partial_tc", Dictionary(
        "standard", torch.randn(s.d_model, 24, generator=g), torch.randn(24, s.d_model, generator=g),
        torch.randn(s.d_model, generator=g), "mlp_in.0", "mlp_out.0", b_enc=torch.randn(24, generator=g),
        space="any"), replace=True)
    vocab = list(range(5, 60))
    data = es.Dataset("random_pairs", tuple(
        es.Example(tuple([1] + [vocab[(7 * i + j) % 55] for j in range(8)]),
                   tuple([1] + [vocab[(11 * i + 3 * j) % 55] for j in range(8)]), answers=(vocab[i],),
                   wrong_answers=(vocab[i + 1],)) for i in range(4)))
    for key, activation in (("test_partial_sae", "resid_post"), ("test_partial_tc", "mlp_out")):
        sites = es.Sites(activation=activation, dictionary=key, over=["position", "feature"], positions="3:",
                         features=[0, 5, 9])
        runs = {mode: es.Patching(method="exact", sites=sites, comparison="difference", prefix_reuse=mode)
                .run(model, data, quiet=True) for mode in ("positions", "off")}
        torch.testing.assert_close(runs["positions"].extra["patched"], runs["off"].extra["patched"],
                                   rtol=1e-5, atol=1e-5)
        assert runs["positions"].extra["path"] == "positions"
        moved = runs["off"].extra["patched"] - runs["off"].extra["m_base"][:, None]
        assert float(moved.abs().max()) > 1e-4  # the patches did something


def test_a_release_folder_covers_its_layers_and_refuses_ambiguity(demo, tmp_path):
    from entoscope.dictionaries import write_folder

    m = adapt(demo)
    D = m.structure.d_model
    g = torch.Generator().manual_seed(4)

    def sae(site):
        return Dictionary("standard", torch.randn(D, 16, generator=g), torch.randn(16, D, generator=g), torch.zeros(D),
                          site, site, b_enc=torch.zeros(16), space="plain")
    write_folder(sae("resid_post.0"), tmp_path / "rel" / "a")
    write_folder(sae("resid_post.2"), tmp_path / "rel" / "b")
    release = str(tmp_path / "rel")
    ss = es.Sites(activation="resid_post", dictionary=release, over=["layer"]).resolve(m)
    assert ss.bases == ((0, f"{release}/a"), (2, f"{release}/b"))
    with pytest.raises(DictionaryError) as err:
        es.Sites(activation="resid_post", dictionary=release, layers=1).resolve(m)
    assert err.value.code == "dictionary_site_mismatch"
    write_folder(sae("resid_post.2"), tmp_path / "rel" / "c")
    with pytest.raises(DictionaryError) as err:
        es.Sites(activation="resid_post", dictionary=release, layers=2).resolve(m)
    assert err.value.code == "dictionary_ambiguous"


def test_feature_reads_are_served_by_a_cached_model(demo, ioi_tokens, tmp_path):
    _, clean, *_ = ioi_tokens
    name = ActName("features", 1, "demo/resid_post.1")
    cached = es.CachedModel(demo, cache_dir=tmp_path / "cache")
    first = adapt(cached).run(clean, [name]).acts[name]
    again = adapt(cached).run(clean, [name]).acts[name]
    assert torch.equal(first, again) and torch.equal(first, adapt(demo).run(clean, [name]).acts[name])
    assert cached.cache_stats()["hits"] >= 1


def test_attribution_on_scalar_slots_adds_up_to_the_whole_activation(demo, ioi_tokens):
    """Neuron (and feature) sites patch one number per slot; attribution over every neuron of a layer sums
    to attribution of the whole activation (the first-order estimate is linear in the change)."""
    data = ioi_tokens[0]
    per_neuron = es.Patching(method="attribution", comparison="difference", sites=es.Sites(
        activation="mlp_post", layers=1, over=["neuron"])).run(demo, data, quiet=True)
    whole = es.Patching(method="attribution", comparison="difference", sites=es.Sites(
        activation="mlp_post", layers=1, over=["layer"])).run(demo, data, quiet=True)
    summed = (per_neuron.extra["patched"] - per_neuron.extra["m_base"][:, None]).sum(1)
    torch.testing.assert_close(summed, (whole.extra["patched"] - whole.extra["m_base"][:, None])[:, 0],
                               rtol=1e-6, atol=1e-6)
