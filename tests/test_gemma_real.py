"""The real Gemma 3 270M (dequantized from GGUF) against transformers' own forward read with hooks written here:
the embedding scale, additivity through the post-norms, the attention pattern on a sliding and a full layer,
the unembedding written by hand, and DLA's identity on IOI prompts. The folder comes from the shared `gemma3_folder`
fixture (tests/conftest.py: fetched from PyPI, or a one-line skip)."""

import pytest
import torch

from entoscope.circuits.dla import DirectLogitAttribution
from entoscope.data import tasks
from entoscope.models import adapt

from extras import require

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def gemma3(gemma3_folder):
    """(an nnsight model around transformers' Gemma 3, the same transformers model)."""
    require("nnsight")
    FOLDER = gemma3_folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entoscope.models.loading import from_hf

    hf = AutoModelForCausalLM.from_pretrained(str(FOLDER), dtype=torch.float32, attn_implementation="eager").eval()
    return from_hf(hf, AutoTokenizer.from_pretrained(str(FOLDER)), backend="nnsight", name=str(FOLDER)), hf


def test_sites_and_logits_are_transformers_own(gemma3):
    model, hf = gemma3
    a = adapt(model)
    s = a.structure
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.d_head) == (18, 640, 4, 1, 256)
    assert s.sliding_layers == tuple(L for L in range(18) if L % 6 != 5) and s.sliding_window == 512
    tokens = torch.tensor([a.tokenize("When Mary and John went to the store, John gave a drink to")])
    seen = {}
    hooks = [hf.model.layers[L].post_attention_layernorm.register_forward_hook(
        lambda m, i, o, L=L: seen.__setitem__(f"attn_out.{L}", o.detach())) for L in (0, 5)]
    with torch.no_grad():
        ref = hf(tokens, output_attentions=True)
    for h in hooks:
        h.remove()
    reads = ["embed", "resid_post.17"] + [f"{k}.{L}" for L in (0, 5) for k in
                                          ("resid_pre", "attn_out", "mlp_out", "resid_post", "pattern")]
    with torch.no_grad():
        out = a.run(tokens, reads)
    acts = {str(k): v for k, v in out.acts.items()}
    torch.testing.assert_close(acts["embed"], hf.model.embed_tokens.weight[tokens] * 640 ** 0.5, atol=1e-4, rtol=1e-5)
    for L in (0, 5):  # a sliding layer and a full one
        torch.testing.assert_close(acts[f"attn_out.{L}"], seen[f"attn_out.{L}"], atol=1e-4, rtol=1e-4)
        summed = acts[f"resid_pre.{L}"] + acts[f"attn_out.{L}"] + acts[f"mlp_out.{L}"]
        torch.testing.assert_close(summed, acts[f"resid_post.{L}"], atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(acts[f"pattern.{L}"], ref.attentions[L], atol=1e-5, rtol=1e-4)
    x = acts["resid_post.17"][0, -1]
    normed = x / torch.sqrt(x.pow(2).mean() + hf.config.rms_norm_eps) * (1 + hf.model.norm.weight)
    torch.testing.assert_close(normed @ hf.lm_head.weight.T, ref.logits[0, -1], atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-3, rtol=1e-4)


def test_dla_rows_sum_to_transformers_logit_difference_on_ioi(gemma3):
    model, hf = gemma3
    a = adapt(model)
    data = tasks.get("ioi", n=4, seed=0, tokenizer=a.tokenizer)
    result = DirectLogitAttribution(batch_size=4).run(model, data, quiet=True)
    pp = result.per_prompt
    for i, ex in enumerate(data):
        ids = torch.tensor([a.tokenize(ex.prompt)])
        with torch.no_grad():
            logits = hf(ids).logits[0, -1].double()
        right = [a.token_id(t) for t in ex.answers]
        wrong = [a.token_id(t) for t in ex.wrong_answers]
        value = float(logits[right].mean() - logits[wrong].mean())
        assert pp[pp.example == i]["contribution"].sum() == pytest.approx(value, abs=1e-3 * max(1.0, abs(value)))
