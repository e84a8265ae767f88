"""The model layer against independent references: HuggingFace's own forward, TransformerLens's
HookedTransformer, and attention/MLP/norm recomputed by hand from the weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from entoscope.errors import SiteError, UnknownNameError, UnsupportedModelError
from entoscope.models import ActName, Intervention, adapt, parse_name
from entoscope.models.tiny import tiny_hf_model

from conftest import get_tiny, has_hooked_transformer

PROMPTS = ["When Mary and John went to the store, John gave a drink to",
           "The capital of France is"]
SOURCE = "When John and Mary went to the store, Mary gave a drink to"  # same length as PROMPTS[0]
ROTARY = {"neox": (8, 10000.0), "llama": (16, 10000.0)}  # (rotary_dim, base) of the tiny configs
ACT = {"gpt2": lambda x: F.gelu(x, approximate="tanh"), "neox": F.gelu, "llama": F.silu}


def tokens(a, text=PROMPTS[0]):
    return torch.tensor([a.tokenize(text)])


# ---------------------------------------------------------------- logits against other implementations
@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_plain_bridge_equals_huggingface(family):
    a = adapt(get_tiny(family, "bridge", False))
    toks = tokens(a)
    reference = tiny_hf_model(family, seed=0)  # a fresh copy with the same seed: same weights
    with torch.no_grad():
        expected = reference(toks).logits
    assert torch.allclose(a.run(toks).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not has_hooked_transformer(), reason="transformer-lens 4.x has no HookedTransformer")
@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_compat_bridge_equals_hooked_transformer(family):
    compat = adapt(get_tiny(family, "bridge", True))
    hooked = adapt(get_tiny(family, "hooked", False))
    toks = tokens(compat)
    assert (compat.run(toks).logits - hooked.run(toks).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_compat_and_plain_give_the_same_distribution(family):
    plain = adapt(get_tiny(family, "bridge", False))
    compat = adapt(get_tiny(family, "bridge", True))
    toks = tokens(plain)
    lp = plain.run(toks).logits.log_softmax(-1)
    lc = compat.run(toks).logits.log_softmax(-1)
    assert (lp - lc).abs().max() <= 1e-4


# ---------------------------------------------------------------- structure
def test_structure_records(tiny):
    a = adapt(tiny)
    s = a.structure
    family = tiny.cfg.model_name.split("-")[-1] if "tiny-" in str(tiny.cfg.model_name) else None
    assert (s.n_layers, s.d_model, s.n_heads, s.d_head) == (2, 64, 4, 16)
    if family == "gpt2":
        assert (s.norm, s.positional, s.parallel, s.gated_mlp, s.n_kv_heads) == ("layernorm", "learned", False, False, 4)
    if family == "neox":
        assert (s.norm, s.positional, s.parallel, s.gated_mlp) == ("layernorm", "rotary", True, False)
    if family == "llama":
        assert (s.norm, s.positional, s.parallel, s.gated_mlp, s.n_kv_heads) == ("rmsnorm", "rotary", False, True, 2)
    assert s.norm_folded == (s.mode in ("compat", "processed"))


def test_non_models_are_refused_with_type_error():
    with pytest.raises(TypeError) as err:
        adapt(torch.nn.Linear(2, 2))
    assert isinstance(err.value, UnsupportedModelError) and "TransformerBridge" in str(err.value)


# ---------------------------------------------------------------- tokenising
def test_tokenize_prepends_bos_like_to_tokens(tiny):
    a = adapt(tiny)
    for text in PROMPTS:
        assert a.tokenize(text) == tiny.to_tokens(text, prepend_bos=True)[0].tolist()
        assert a.tokenize(text)[0] == a.bos_token_id
        assert a.tokenize(text, prepend_bos=False) == a.tokenize(text)[1:]


# ---------------------------------------------------------------- identities of the residual stream
def test_residual_stream_adds_up(tiny):
    a = adapt(tiny)
    s = a.structure
    names = [f"{k}.{L}" for L in range(s.n_layers) for k in ("resid_pre", "resid_post", "attn_out", "mlp_out")]
    if not s.parallel:
        names += [f"resid_mid.{L}" for L in range(s.n_layers)]
    out = a.run(tokens(a), names)
    for L in range(s.n_layers):
        pre, post = out[f"resid_pre.{L}"], out[f"resid_post.{L}"]
        if s.parallel:
            torch.testing.assert_close(pre + out[f"attn_out.{L}"] + out[f"mlp_out.{L}"], post, atol=1e-5, rtol=0)
        else:
            mid = out[f"resid_mid.{L}"]
            torch.testing.assert_close(pre + out[f"attn_out.{L}"], mid, atol=1e-5, rtol=0)
            torch.testing.assert_close(mid + out[f"mlp_out.{L}"], post, atol=1e-5, rtol=0)
        if L + 1 < s.n_layers:
            assert torch.equal(post, out[f"resid_pre.{L + 1}"])



def test_writing_resid_mid_changes_the_residual_not_only_the_mlp_input(tiny):
    """resid_mid is the residual between attention and MLP: writing a source run's resid_mid at every
    position must give the source run's logits, and adding v there must equal adding v to attn_out
    (both add to the same residual). A bridge's hook_resid_mid is only the MLP norm's input."""
    a = adapt(tiny)
    s = a.structure
    base, source = tokens(a), tokens(a, SOURCE)
    if s.parallel:  # no residual between attention and MLP: refused, never written somewhere else
        with pytest.raises(SiteError) as err:
            a.run(base, interventions=[Intervention.add("resid_mid.0", torch.zeros(s.d_model))])
        assert err.value.code == "no_resid_mid"
        return
    v = torch.randn(s.d_model, generator=torch.Generator().manual_seed(0))
    for L in range(s.n_layers):
        src = a.run(source, [f"resid_mid.{L}"])
        out = a.run(base, interventions=[Intervention.replace(f"resid_mid.{L}", src[f"resid_mid.{L}"])])
        torch.testing.assert_close(out.logits, src.logits, atol=1e-4, rtol=0)
        via_mid = a.run(base, interventions=[Intervention.add(f"resid_mid.{L}", v)]).logits
        via_attn = a.run(base, interventions=[Intervention.add(f"attn_out.{L}", v)]).logits
        torch.testing.assert_close(via_mid, via_attn, atol=1e-4, rtol=0)

def test_embeddings_are_rows_of_W_E_and_W_pos(tiny):
    a = adapt(tiny)
    toks = tokens(a)
    names = ["embed", "resid_pre.0"] + (["pos_embed"] if a.structure.positional == "learned" else [])
    out = a.run(toks, names)
    torch.testing.assert_close(out["embed"][0], a.weights.W_E[toks[0]], atol=1e-6, rtol=0)
    if a.structure.positional == "learned":
        torch.testing.assert_close(out["pos_embed"][0], a.weights.W_pos[: toks.shape[1]], atol=1e-6, rtol=0)
        torch.testing.assert_close(out["embed"] + out["pos_embed"], out["resid_pre.0"], atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(out["embed"], out["resid_pre.0"], atol=1e-6, rtol=0)


def test_final_norm_and_unembedding_give_the_logits(tiny):
    a = adapt(tiny)
    last = a.structure.n_layers - 1
    out = a.run(tokens(a), [f"resid_post.{last}", "final_scale"])
    norm = a.weights.final_norm
    resid = out[f"resid_post.{last}"]
    torch.testing.assert_close(norm.scale(resid), out["final_scale"], atol=1e-5, rtol=1e-5)
    logits = norm(resid) @ a.weights.W_U + a.weights.b_U
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- weights reproduce the computation
def _rotate(x, rotary_dim, base):
    """GPT-NeoX-style rotary on the first rotary_dim dims of x [b, p, h, d] (written from the paper)."""
    pos = torch.arange(x.shape[1], dtype=torch.float32)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.cat([pos[:, None] * inv_freq[None]] * 2, dim=-1)  # [p, rd]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def _family(model):
    return str(model.cfg.model_name).split("tiny-")[-1]


def test_attention_recomputed_from_weights(tiny):
    a = adapt(tiny)
    w, s, fam = a.weights, a.structure, _family(tiny)
    L = 1
    out = a.run(tokens(a), [f"attn_in.{L}", f"pattern.{L}", f"z.{L}", f"attn_out.{L}", f"result.{L}",
                            f"k.{L}", f"v.{L}"])
    x = out[f"attn_in.{L}"]
    q = torch.einsum("bpd,hde->bphe", x, w.W_Q(L)) + w.b_Q(L)
    k = torch.einsum("bpd,hde->bphe", x, w.W_K(L)) + w.b_K(L)
    v = torch.einsum("bpd,hde->bphe", x, w.W_V(L)) + w.b_V(L)
    # grouped-query: the backend's own k/v (one per kv head) expanded h -> h // group equal ours
    torch.testing.assert_close(out[f"k.{L}"].repeat_interleave(s.group_size, dim=2), k, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[f"v.{L}"].repeat_interleave(s.group_size, dim=2), v, atol=1e-5, rtol=0)
    if fam in ROTARY:
        q, k = _rotate(q, *ROTARY[fam]), _rotate(k, *ROTARY[fam])
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(s.d_head)
    n = x.shape[1]
    scores = scores.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
    pattern = scores.softmax(-1)
    torch.testing.assert_close(pattern, out[f"pattern.{L}"], atol=1e-5, rtol=0)
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    torch.testing.assert_close(z, out[f"z.{L}"], atol=1e-5, rtol=0)
    attn_out = torch.einsum("bqhe,hem->bqm", z, w.W_O(L)) + w.b_O(L)
    torch.testing.assert_close(attn_out, out[f"attn_out.{L}"], atol=1e-5, rtol=0)
    # per-head results sum, with the output bias, to attn_out
    torch.testing.assert_close(out[f"result.{L}"].sum(2) + w.b_O(L), out[f"attn_out.{L}"], atol=1e-5, rtol=0)


def test_mlp_recomputed_from_weights(tiny):
    a = adapt(tiny)
    w, fam = a.weights, _family(tiny)
    L = 0
    out = a.run(tokens(a), [f"mlp_in.{L}", f"mlp_post.{L}", f"mlp_out.{L}"])
    x = out[f"mlp_in.{L}"]
    if a.structure.gated_mlp:
        post = ACT[fam](x @ w.W_gate(L)) * (x @ w.W_in(L) + w.b_in(L))
    else:
        post = ACT[fam](x @ w.W_in(L) + w.b_in(L))
    torch.testing.assert_close(post, out[f"mlp_post.{L}"], atol=1e-5, rtol=0)
    torch.testing.assert_close(post @ w.W_out(L) + w.b_out(L), out[f"mlp_out.{L}"], atol=1e-5, rtol=0)


def test_norms_reproduce_the_normalised_inputs(tiny):
    a = adapt(tiny)
    s = a.structure
    L = 1
    names = [f"resid_pre.{L}", f"attn_in.{L}", f"mlp_in.{L}", f"ln1_scale.{L}", f"ln2_scale.{L}"]
    if not s.parallel:
        names.append(f"resid_mid.{L}")
    out = a.run(tokens(a), names)
    ln1, ln2 = a.weights.norm(L, "ln1"), a.weights.norm(L, "ln2")
    mlp_reads = out[f"resid_pre.{L}"] if s.parallel else out[f"resid_mid.{L}"]
    torch.testing.assert_close(ln1(out[f"resid_pre.{L}"]), out[f"attn_in.{L}"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln2(mlp_reads), out[f"mlp_in.{L}"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln1.scale(out[f"resid_pre.{L}"]), out[f"ln1_scale.{L}"], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not has_hooked_transformer(), reason="transformer-lens 4.x has no HookedTransformer")
def test_grouped_query_expansion_matches_transformer_lens():
    hooked = get_tiny("llama", "hooked", False)
    a = adapt(hooked)
    for L in range(2):
        # TransformerLens's GroupedQueryAttention expands its own _W_K/_W_V with repeat_interleave
        assert torch.equal(a.weights.W_K(L), hooked.blocks[L].attn.W_K)
        assert torch.equal(a.weights.W_V(L), hooked.blocks[L].attn.W_V)
        assert a.weights.W_K_kv(L).shape[0] == 2


# ---------------------------------------------------------------- interventions
def test_replacing_resid_pre_0_everywhere_reproduces_the_source_run(tiny):
    a = adapt(tiny)
    clean = torch.tensor([a.tokenize(PROMPTS[0])])
    source = torch.tensor([a.tokenize(SOURCE)])
    assert clean.shape == source.shape
    src = a.run(source, ["resid_pre.0"])
    patched = a.run(clean, interventions=[Intervention.replace("resid_pre.0", src["resid_pre.0"])])
    torch.testing.assert_close(patched.logits, src.logits, atol=1e-5, rtol=0)
    assert not torch.allclose(a.run(clean).logits, src.logits, atol=1e-3)


@pytest.mark.parametrize("kind", ["z", "result", "v", "q", "pattern", "attn_in"])
def test_writing_an_attention_site_moves_attn_out_to_the_source(tiny, kind):
    a = adapt(tiny)
    L = 1
    clean = torch.tensor([a.tokenize(PROMPTS[0])])
    source = torch.tensor([a.tokenize(SOURCE)])
    site = f"{kind}.{L}"
    src = a.run(source, [site, f"attn_out.{L}"])
    patched = a.run(clean, [f"attn_out.{L}"], interventions=[Intervention.replace(site, src[site])])
    # every input of attention that came from the source run: attn_out is the source's where it
    # depends only on the patched site (q/pattern alone leave v clean, so those are checked by sum)
    if kind in ("z", "result", "attn_in"):
        torch.testing.assert_close(patched[f"attn_out.{L}"], src[f"attn_out.{L}"], atol=1e-5, rtol=0)
    else:
        base = a.run(clean, [f"attn_out.{L}"])
        assert not torch.allclose(patched[f"attn_out.{L}"], base[f"attn_out.{L}"], atol=1e-6)


def test_writing_mlp_post_moves_mlp_out_to_the_source(tiny):
    a = adapt(tiny)
    clean = torch.tensor([a.tokenize(PROMPTS[0])])
    source = torch.tensor([a.tokenize(SOURCE)])
    src = a.run(source, ["mlp_post.0", "mlp_out.0"])
    patched = a.run(clean, ["mlp_out.0"], interventions=[Intervention.replace("mlp_post.0", src["mlp_post.0"])])
    torch.testing.assert_close(patched["mlp_out.0"], src["mlp_out.0"], atol=1e-5, rtol=0)


def test_adding_to_attn_out_adds_to_the_residual(tiny):
    a = adapt(tiny)
    toks = tokens(a)
    delta = torch.randn(a.structure.d_model, generator=torch.Generator().manual_seed(0))
    # the residual right after attention: resid_mid (sequential), resid_post (parallel: the MLP
    # read resid_pre, so it does not see the change)
    after = "resid_post.0" if a.structure.parallel else "resid_mid.0"
    base = a.run(toks, [after])
    added = a.run(toks, [after], interventions=[Intervention.add("attn_out.0", delta, (slice(None), 3))])
    diff = added[after] - base[after]
    torch.testing.assert_close(diff[0, 3], delta, atol=1e-5, rtol=1e-5)
    assert diff[0, :3].abs().max() == 0


@pytest.mark.parametrize("kind", ["q", "k", "v", "z", "pattern", "mlp_post"])
def test_gradients_reach_every_read_kind(tiny, kind):
    a = adapt(tiny)
    out = a.run(tokens(a), [f"{kind}.1"], grad=True)
    (g,) = torch.autograd.grad(out.logits[0, -1, 5], out[f"{kind}.1"])
    assert g is not None and g.abs().sum() > 0


def test_gradients_flow_to_read_activations(tiny):
    a = adapt(tiny)
    toks = tokens(a)
    out = a.run(toks, ["resid_pre.1"], grad=True)
    target = out.logits[0, -1, 5]
    (g,) = torch.autograd.grad(target, out["resid_pre.1"], retain_graph=True)
    assert g.shape == out["resid_pre.1"].shape and g[0, -1].abs().sum() > 0
    (g3,) = torch.autograd.grad(out.logits[0, 3, 5], out["resid_pre.1"])
    assert g3[0, 4:].abs().max() == 0 and g3[0, 3].abs().sum() > 0  # causal: later positions never matter
    # a finite difference along the gradient agrees with it (first order)
    eps = 1e-3
    direction = g / g.norm()
    bumped = a.run(toks, interventions=[Intervention.add("resid_pre.1", eps * direction)])
    fd = (bumped.logits[0, -1, 5] - target.detach()) / eps
    assert abs(fd.item() - g.norm().item()) < 0.05 * g.norm().item() + 1e-3


# ---------------------------------------------------------------- padding
def test_right_padded_batch_equals_one_prompt_runs(tiny):
    a = adapt(tiny)
    ids = [a.tokenize(p) for p in PROMPTS]
    width = max(map(len, ids))
    pad = a.bos_token_id
    batch = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    out = a.run(batch, ["resid_post.1", "pattern.0"])
    for row, i in enumerate(ids):
        alone = a.run(torch.tensor([i]), ["resid_post.1", "pattern.0"])
        n = len(i)
        torch.testing.assert_close(out.logits[row, :n], alone.logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["resid_post.1"][row, :n], alone["resid_post.1"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["pattern.0"][row, :, :n, :n], alone["pattern.0"][0], atol=1e-6, rtol=0)


def test_a_run_without_logits_stops_after_the_last_block_read(tiny):
    a = adapt(tiny)
    x = tokens(a)
    full = a.run(x, ["resid_post.0", "z.0"])
    calls = []
    handle = a.module.blocks[-1].register_forward_hook(lambda *args: calls.append(1))
    try:
        short = a.run(x, ["resid_post.0", "z.0"], logits=False)
        assert short.logits is None
        assert calls == []  # the last block never ran (the tiny models have 2+ layers)
        for name in ("resid_post.0", "z.0"):
            torch.testing.assert_close(short[name], full[name], atol=1e-6, rtol=0)
        everything = a.run(x, ["resid_post.0", "final_scale"], logits=False)  # a read after the blocks
        assert everything.logits is None and calls == [1]
    finally:
        handle.remove()


def test_logits_at_chosen_positions_are_the_full_runs_rows(tiny):
    """Right-padded prompts of different lengths: each row's logits at its own last position (a bridge asks
    HuggingFace to unembed the last positions only) equal those rows of the full logits."""
    a = adapt(tiny)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(1, 300, (3, 9), generator=g)
    last = torch.tensor([8, 5, 6])
    full = a.run(x, ["resid_post.1"])
    some = a.run(x, ["resid_post.1"], logits_at=last)
    torch.testing.assert_close(some.logits, full.logits[torch.arange(3), last], atol=1e-5, rtol=0)
    torch.testing.assert_close(some["resid_post.1"], full["resid_post.1"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- names
def test_aliases_resolve_to_canonical_names():
    assert parse_name("blocks.5.hook_resid_post") == ActName("resid_post", 5)
    assert parse_name("blocks.2.attn.hook_z") == ActName("z", 2)
    assert parse_name("layers_output[5]") == ActName("resid_post", 5)
    assert parse_name("layers_input[0]") == ActName("resid_pre", 0)
    assert parse_name("mlps_output[1]") == ActName("mlp_out", 1)
    assert parse_name("ln_final.hook_scale") == ActName("final_scale")
    assert parse_name("resid_pre.-1", n_layers=12) == ActName("resid_pre", 11)
    assert str(ActName("z", 3)) == "z.3" and parse_name("z.3") == ActName("z", 3)


def test_unservable_and_unknown_names_say_what_to_use():
    with pytest.raises(UnknownNameError) as err:
        parse_name("blocks.3.hook_attn_in")
    assert err.value.code == "alias_unservable" and "resid_pre.3" in str(err.value)
    with pytest.raises(KeyError) as err:
        parse_name("resid_pree.3")
    assert err.value.code == "unknown_activation"
    with pytest.raises(UnknownNameError) as err:
        parse_name("resid_pre")
    assert err.value.code == "layer_missing"


def test_model_specific_refusals():
    neox = adapt(get_tiny("neox", "bridge", False))
    with pytest.raises(SiteError) as err:
        neox.resolve("resid_mid.0")
    assert err.value.code == "no_resid_mid"
    with pytest.raises(SiteError) as err:
        neox.resolve("pos_embed")
    assert err.value.code == "no_learned_positions"
    gpt2 = adapt(get_tiny("gpt2", "bridge", False))
    with pytest.raises(SiteError) as err:
        gpt2.resolve("resid_pre.2")
    assert err.value.code == "site_out_of_range" and "0..1" in str(err.value)
    assert gpt2.resolve("final_resid") == ActName("resid_post", 1)


def test_multi_token_answers_are_refused(tiny):
    a = adapt(tiny)
    assert a.token_id(a.tokenize(" Mary", prepend_bos=False)[0]) == a.tokenize(" Mary", prepend_bos=False)[0]
    with pytest.raises(ValueError) as err:
        a.token_id(" Mary and John went to the store")
    assert err.value.code == "multi_token_answer"
