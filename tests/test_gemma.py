"""The Gemma families (docs/families.md) on tiny random Gemma 3 and Gemma 2 models, against transformers' own
forward read with hooks written here: the embedding scale, (1 + weight) norms, post-norms (attn_out and mlp_out
are what is added to the residual stream), sliding windows, q/k norms, soft caps, the attention pattern
against eager attention's weights, the unembedding written out by hand, and the post-norm convention of every
decomposition (heads through the post-norm with its scale frozen: DLA's identity, EAP's senders, IFR's parts)."""

import pytest
import torch

from entoscope.circuits.decompose import component_dots, component_vectors, components, decomposition_reads
from entoscope.circuits.dla import DirectLogitAttribution
from entoscope.circuits.edge_patching import corrupt_senders, run_with_edges
from entoscope.circuits.graph import ComponentGraph
from entoscope.circuits.ifr import flow_importances, flow_reads
from entoscope.errors import EntoscopeError
from entoscope.models import adapt
from entoscope.models.tiny import tiny_hf_model

from conftest import get_tiny, random_pair_batch
from test_dla import random_data


VARIANTS = [(f, b, c) for f in ("gemma3", "gemma2") for b, c in (("bridge", False), ("bridge", True), ("nnsight", False))]
IDS = [f"{f}-{b}{'-compat' if c else ''}" for f, b, c in VARIANTS]
TOKENS = torch.tensor([[0, 11, 45, 201, 7, 99, 150, 3, 60], [0, 3, 4, 5, 6, 8, 9, 12, 14]])  # 9 > the window of 4


def reference(family):
    """transformers' own forward of a fresh copy of the same model (same seed), with hooks written here."""
    hf = tiny_hf_model(family)
    seen = {}

    def keep(name, index=None):
        def hook(module, args, out):
            seen[name] = (args[0] if index == "in" else out[0] if isinstance(out, tuple) else out).detach()
        return hook

    for L, layer in enumerate(hf.model.layers):
        layer.post_attention_layernorm.register_forward_hook(keep(f"attn_out.{L}"))
        layer.post_feedforward_layernorm.register_forward_hook(keep(f"mlp_out.{L}"))
        layer.self_attn.o_proj.register_forward_hook(keep(f"o_proj.{L}"))
        layer.self_attn.o_proj.register_forward_hook(keep(f"z.{L}", "in"))
        layer.register_forward_hook(keep(f"resid_post.{L}"))
    with torch.no_grad():
        out = hf(TOKENS, output_attentions=True)
    seen["logits"] = out.logits.detach()
    seen["pattern"] = [a.detach() for a in out.attentions]
    return hf, seen


def rms(x, eps):
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_the_structure_record_reads_the_family(variant):
    s = adapt(get_tiny(*variant)).structure
    assert (s.norm_offset, s.embed_scale, s.post_norms, s.sliding_window, s.sliding_layers) == (1.0, 8.0, True, 4, (0,))
    assert s.attn_scale == pytest.approx(24 ** 0.5)  # query_pre_attn_scalar 24, not d_head 16
    assert s.qk_norm == (variant[0] == "gemma3")
    assert (s.attn_softcap, s.final_softcap) == ((None, None) if variant[0] == "gemma3" else (5.0, 3.0))
    text = s.describe()
    assert "embed scale    8" in text and "(1 + weight)" in text and "sliding window 4 on 1 of 2" in text


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_sites_are_transformers_own_values(variant):
    family, _, compat = variant
    a = adapt(get_tiny(*variant))
    hf, ref = reference(family)
    n, eps = a.structure.n_layers, hf.config.rms_norm_eps
    reads = ["embed"] + [f"{k}.{L}" for L in range(n) for k in
                         ("resid_pre", "attn_out", "mlp_out", "resid_post", "pattern", "ln1_post_scale", "ln2_post_scale")]
    with torch.no_grad():
        out = a.run(TOKENS, reads)
    acts = {str(k): v for k, v in out.acts.items()}
    # the embedding as it enters the residual stream: W_E[token] * sqrt(d_model)
    by_hand = hf.model.embed_tokens.weight[TOKENS] * 64 ** 0.5
    torch.testing.assert_close(acts["embed"], by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acts["resid_pre.0"], acts["embed"], atol=0, rtol=0)
    torch.testing.assert_close(a.weights.embedding(TOKENS), by_hand, atol=1e-5, rtol=1e-5)
    for L in range(n):
        # additivity: what is added to the residual stream is the post-normed output
        summed = acts[f"resid_pre.{L}"] + acts[f"attn_out.{L}"] + acts[f"mlp_out.{L}"]
        torch.testing.assert_close(summed, acts[f"resid_post.{L}"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(acts[f"pattern.{L}"], ref["pattern"][L], atol=1e-5, rtol=1e-5)
        if not compat:  # compatibility mode changes the weights (folded norms), not the attention
            torch.testing.assert_close(acts[f"attn_out.{L}"], ref[f"attn_out.{L}"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(acts[f"mlp_out.{L}"], ref[f"mlp_out.{L}"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(acts[f"ln1_post_scale.{L}"], rms(ref[f"o_proj.{L}"], eps), atol=1e-5, rtol=1e-5)
    window = acts["pattern.0"][0, 0]  # layer 0 slides: query i sees keys i-3..i only
    q, k = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    assert bool((window[(q - k >= 4) | (k > q)] == 0).all()) and bool((window[(q - k < 4) & (k <= q)] > 0).all())
    assert bool((acts["pattern.1"][0, 0][k <= q] > 0).all())  # layer 1 sees every earlier key
    logits = out.logits
    if compat:  # compatibility mode centres the unembedding: the same distribution
        logits, ref["logits"] = logits.log_softmax(-1), ref["logits"].log_softmax(-1)
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v[2]], ids=[i for i, v in zip(IDS, VARIANTS) if not v[2]])
def test_logits_are_the_unembedded_final_residual_written_by_hand(variant):
    """logits = cap(W_U (x / rms(x) * (1 + w))) with x the final resid_post entoscope reads (cap: Gemma 2's)."""
    family = variant[0]
    a = adapt(get_tiny(*variant))
    hf, ref = reference(family)
    with torch.no_grad():
        x = a.run(TOKENS, [f"resid_post.{a.structure.n_layers - 1}"]).acts
    x = next(iter(x.values()))
    normed = x / rms(x, hf.config.rms_norm_eps) * (1 + hf.model.norm.weight)
    logits = normed @ hf.lm_head.weight.T
    if family == "gemma2":
        logits = 3.0 * torch.tanh(logits / 3.0)
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_a_heads_result_is_its_output_through_the_frozen_post_norm(variant):
    """result_h = (z_h @ W_O[h]) * (1 + w) / s, s the post-attention norm's scale of the run; the heads sum to attn_out."""
    family, _, compat = variant
    a = adapt(get_tiny(*variant))
    with torch.no_grad():
        acts = {str(k): v for k, v in a.run(TOKENS, ["result.1", "attn_out.1", "z.1", "ln1_post_scale.1"]).acts.items()}
    torch.testing.assert_close(acts["result.1"].sum(2), acts["attn_out.1"], atol=1e-5, rtol=1e-5)
    if compat:
        return
    hf, _ = reference(family)
    attn = hf.model.layers[1]
    W_O = attn.self_attn.o_proj.weight.T.reshape(4, 16, 64)  # [head, d_head, d_model], from transformers' own weight
    gain = 1 + attn.post_attention_layernorm.weight
    by_hand = torch.einsum("bphd,hdm->bphm", acts["z.1"], W_O) * gain / acts["ln1_post_scale.1"][:, :, None]
    torch.testing.assert_close(acts["result.1"], by_hand, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[0] == "gemma3"], ids=[i for i in IDS if "gemma3" in i])
def test_dla_components_sum_to_the_models_logit_difference(variant):
    """DLA on Gemma 3: rows + constant = the logit difference of transformers' own forward (no bias: constant 0);
    heads, b_O, neurons and b_out carried through the post-norms add up to the final residual stream."""
    a = adapt(get_tiny(*variant))
    data = random_data(4, seed=3, vocab=300)
    result = DirectLogitAttribution(neurons=True, neuron_layers=[1]).run(a, data, quiet=True)
    hf = tiny_hf_model("gemma3")
    pp = result.per_prompt
    for i, ex in enumerate(data):
        with torch.no_grad():
            logits = hf(torch.tensor([list(ex.prompt)])).logits[0, -1].double()
        value = logits[list(ex.answers)].mean() - logits[list(ex.wrong_answers)].mean()
        total = pp[pp.example == i]["contribution"].sum()
        assert total == pytest.approx(float(value), abs=1e-4 * max(1.0, abs(float(value))))
    s, last = a.structure, torch.tensor([8, 8])
    for split in ([], [0, 1]):
        with torch.no_grad():
            out = a.run(TOKENS, decomposition_reads(s, split) + [f"resid_post.{s.n_layers - 1}"])
        vecs = component_vectors(a, out.acts, last, split, dtype=torch.float64)
        assert vecs.shape[0] == len(components(s, split))
        final = out.acts[next(k for k in out.acts if str(k) == f"resid_post.{s.n_layers - 1}")][:, -1].double()
        torch.testing.assert_close(vecs.sum(0), final, atol=2e-5, rtol=1e-6)
        direction = torch.randn(2, s.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        dots = component_dots(a, out.acts, last, direction, split)  # neurons through the post-norm's adjoint
        torch.testing.assert_close(dots, (vecs * direction[None]).sum(-1), atol=1e-8, rtol=1e-8)


def test_dla_refuses_a_soft_capped_model():
    with pytest.raises(EntoscopeError) as err:
        DirectLogitAttribution().plan(get_tiny("gemma2", "bridge", False), random_data(2))
    assert err.value.code == "logit_softcap"


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_every_edge_kept_is_the_clean_run_and_none_the_corrupt_run(variant):
    """EAP's senders through the post-norms (each run's own scale): receivers rebuilt from them give back both runs."""
    a = adapt(get_tiny(*variant))
    graph = ComponentGraph.from_model(a)
    b = random_pair_batch(0, 3, 9, corrupt_to=4)
    C, corrupt_logits = corrupt_senders(a, b)
    with torch.no_grad():
        clean_logits = a.run(b.tokens).logits
        everything = graph.mask.clone()
        torch.testing.assert_close(run_with_edges(a, b.tokens, C, graph, everything), clean_logits, atol=1e-5, rtol=0)
        nothing = torch.zeros_like(everything)
        torch.testing.assert_close(run_with_edges(a, b.tokens, C, graph, nothing), corrupt_logits, atol=1e-4, rtol=1e-4)


def test_ifr_attention_parts_are_carried_through_the_post_norm():
    """IFR's head shares at the last node, against proximities computed here from transformers' own modules."""
    a = adapt(get_tiny("gemma3", "bridge", False))
    with torch.no_grad():
        acts = a.run(TOKENS[:1], flow_reads(a.structure)).acts
    imp = flow_importances(a, acts, "head")
    hf, ref = reference("gemma3")
    L, i = 1, 8
    layer = hf.model.layers[L]
    with torch.no_grad():
        v = layer.self_attn.v_proj(layer.input_layernorm(ref[f"resid_post.{L - 1}"][:1]))  # [1, T, d_head]: 1 kv head
    W_O = layer.self_attn.o_proj.weight.T.reshape(4, 16, 64)
    scale = rms(ref[f"o_proj.{L}"][0, i], hf.config.rms_norm_eps)
    gain = 1 + layer.post_attention_layernorm.weight
    with torch.no_grad():
        parts = ref["pattern"][L][0, :, i, :, None] * torch.einsum("kd,hdm->hkm", v[0], W_O) * gain / scale  # [H, j, d]
    pre = ref[f"resid_post.{L - 1}"][0, i]
    node = pre + ref[f"attn_out.{L}"][0, i]
    torch.testing.assert_close(parts.sum((0, 1)) + pre, node, atol=1e-4, rtol=1e-4)  # the parts add up
    prox = (node.abs().sum() - (node - parts).abs().sum(-1)).clamp(min=0).double()
    prox_res = (node.abs().sum() - (node - pre).abs().sum()).clamp(min=0).double()
    shares = prox / (prox.sum() + prox_res)  # Gemma has no b_O: its part is 0, with proximity 0
    torch.testing.assert_close(imp.attn[L][0, i, :, : i + 1].double(), shares[:, : i + 1], atol=1e-5, rtol=1e-4)


def test_an_architecture_without_a_row_is_refused_naming_what_it_lacks(monkeypatch):
    from entoscope.models import hf_families
    from entoscope.models.tiny import tiny_model

    monkeypatch.delitem(hf_families.FAMILIES, "Gemma3ForCausalLM")
    with pytest.raises(EntoscopeError) as err:
        tiny_model("gemma3", "bridge")
    assert err.value.code == "family_unsupported"
    assert "(1 + weight)" in str(err.value) and "norms after attention" in str(err.value)


def test_a_hooked_transformer_of_gemma_is_refused_with_a_code():
    from transformers import Gemma3TextConfig

    from entoscope.models.hooked_config import hooked_config_dict

    with pytest.raises(EntoscopeError) as err:
        hooked_config_dict(Gemma3TextConfig(architectures=["Gemma3ForCausalLM"]))
    assert err.value.code == "family_unsupported"


def test_the_lens_refuses_z_on_a_post_norm_family():
    from entoscope.lens.operation import Lens
    from entoscope.sites import Sites

    with pytest.raises(EntoscopeError) as err:
        Lens(sites=Sites(activation="z", layers=[0])).plan(get_tiny("gemma3", "bridge", False), random_data(2))
    assert err.value.code == "lens_through_post_norm"


@pytest.mark.parametrize("backend", ["bridge", "nnsight"])
def test_a_cached_gemma_serves_the_post_norm_sites_and_dla_from_disk(tmp_path, backend):
    """CachedModel around Gemma 3: the second DLA run reads its activations (post-norm scales included) from the
    cache and gives the same table as the model itself."""
    from entoscope.models.cached import CachedModel

    model = get_tiny("gemma3", backend, False)
    data = random_data(3, seed=4)
    plain = DirectLogitAttribution().run(model, data, quiet=True).per_prompt
    cm = CachedModel(model, tmp_path)
    first = DirectLogitAttribution().run(cm, data, quiet=True).per_prompt
    second = DirectLogitAttribution().run(cm, data, quiet=True).per_prompt
    assert cm.cache_stats()["hits"] >= 1
    for table in (first, second):
        assert table["contribution"].to_numpy() == pytest.approx(plain["contribution"].to_numpy(), abs=1e-6)


@pytest.mark.parametrize("backend", ["bridge", "nnsight"])
def test_gemma_1_passes_the_load_checks_and_dla_sums_to_its_logit_difference(backend):
    """Gemma 1's row: (1 + weight) norms and a scaled embedding, no post-norms (HF's post_attention_layernorm is
    its pre-MLP norm there). Loading checks unembed(final_norm(last resid_post)) = logits; DLA's rows add up."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(0)
    cfg = GemmaConfig(architectures=["GemmaForCausalLM"], num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, intermediate_size=128, max_position_embeddings=64,
                      vocab_size=len(tiny_tokenizer()), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    hf = GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    data = random_data(3, seed=5)
    with torch.no_grad():
        reference = [hf(torch.tensor([list(ex.prompt)])).logits[0, -1].double() for ex in data]
    model = from_hf(hf, tiny_tokenizer(), backend=backend, folder=tokenizer_dir())
    s = adapt(model).structure
    assert (s.norm_offset, s.embed_scale, s.post_norms) == (1.0, 8.0, False)
    pp = DirectLogitAttribution().run(model, data, quiet=True).per_prompt
    for i, (ex, logits) in enumerate(zip(data, reference)):
        value = float(logits[list(ex.answers)].mean() - logits[list(ex.wrong_answers)].mean())
        assert pp[pp.example == i]["contribution"].sum() == pytest.approx(value, abs=1e-4 * max(1.0, abs(value)))


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_writing_a_heads_result_changes_attn_out_by_that_much(variant):
    """The result write convention under a post-norm: attn_out' = attn_out + (new_h - result_h), the post-norm's
    scale of the run frozen (not recomputed), so zeroing head 2 removes exactly its result from attn_out."""
    from entoscope.models.adapter import Intervention

    a = adapt(get_tiny(*variant))

    def zero_head_2(result):
        result = result.clone()
        result[:, :, 2] = 0
        return result

    with torch.no_grad():
        clean = {str(k): v for k, v in a.run(TOKENS, ["result.0", "attn_out.0"]).acts.items()}
        edited = a.run(TOKENS, ["attn_out.0"], interventions=[Intervention("result.0", zero_head_2)]).acts
    torch.testing.assert_close(next(iter(edited.values())), clean["attn_out.0"] - clean["result.0"][:, :, 2],
                               atol=1e-5, rtol=1e-5)
