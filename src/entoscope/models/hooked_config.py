"""Build a HookedTransformer from a HuggingFace model object or a local folder (no hub access).

`HookedTransformer.from_pretrained` only accepts names from TransformerLens's official list, so a
local folder (the bundled demo model, a checkpoint of one's own) or a model built from a config
goes through here: the HuggingFace config is mapped to a `HookedTransformerConfig`, the weights are
converted by TransformerLens's own per-family converters, and TransformerLens's own processing
(fold LayerNorm, centre writing weights and unembedding, fold value biases) is applied.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError

_FAMILIES = ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
             "MistralForCausalLM")


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def _architecture(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    by_type = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    for arch in archs:
        if arch in _FAMILIES:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if model_type in by_type:
        return by_type[model_type]
    raise UnsupportedModelError(
        f"entoscope cannot build a HookedTransformer for architecture {archs or model_type!r} from a "
        f"local folder; it knows {', '.join(_FAMILIES)}", code="family_unsupported",
        remedy="use the bridge backend (--backend bridge), which supports every architecture "
        "TransformerLens's TransformerBridge does, or a hub name HookedTransformer.from_pretrained knows",
    )


def hooked_config_dict(hf_config: Any) -> dict[str, Any]:
    """The HookedTransformerConfig fields for one of the supported HuggingFace configs."""
    arch = _architecture(hf_config)
    c = hf_config
    if arch == "GPT2LMHeadModel":
        d = {
            "d_model": c.n_embd, "d_head": c.n_embd // c.n_head, "n_heads": c.n_head,
            "d_mlp": getattr(c, "n_inner", None) or 4 * c.n_embd, "n_layers": c.n_layer,
            "n_ctx": c.n_positions, "eps": c.layer_norm_epsilon, "d_vocab": c.vocab_size,
            "act_fn": c.activation_function, "use_attn_scale": getattr(c, "scale_attn_weights", True),
            "scale_attn_by_inverse_layer_idx": getattr(c, "scale_attn_by_inverse_layer_idx", False),
            "normalization_type": "LN", "positional_embedding_type": "standard",
        }
    elif arch == "GPTNeoXForCausalLM":
        d_head = c.hidden_size // c.num_attention_heads
        rotary_pct = getattr(c, "rotary_pct", None)
        if rotary_pct is None:
            rotary_pct = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        d = {
            "d_model": c.hidden_size, "d_head": d_head, "n_heads": c.num_attention_heads,
            "d_mlp": c.intermediate_size, "n_layers": c.num_hidden_layers,
            "n_ctx": c.max_position_embeddings, "eps": c.layer_norm_eps, "d_vocab": c.vocab_size,
            "act_fn": c.hidden_act, "parallel_attn_mlp": getattr(c, "use_parallel_residual", True),
            "positional_embedding_type": "rotary", "rotary_adjacent_pairs": False,
            "rotary_dim": round(rotary_pct * d_head), "rotary_base": _rope_theta(c),
            "normalization_type": "LN",
        }
    else:  # Llama, Qwen2, Mistral: RMSNorm, rotary, gated MLP, grouped-query attention
        d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        d = {
            "d_model": c.hidden_size, "d_head": d_head, "n_heads": c.num_attention_heads,
            "d_mlp": c.intermediate_size, "n_layers": c.num_hidden_layers,
            "n_ctx": c.max_position_embeddings, "eps": c.rms_norm_eps, "d_vocab": c.vocab_size,
            "act_fn": c.hidden_act, "normalization_type": "RMS", "positional_embedding_type": "rotary",
            "rotary_adjacent_pairs": False, "rotary_dim": d_head, "rotary_base": _rope_theta(c),
            "final_rms": True, "gated_mlp": True,
        }
        n_kv = getattr(c, "num_key_value_heads", None)
        if n_kv is not None and n_kv != c.num_attention_heads:
            d["n_key_value_heads"] = n_kv
        scaling = getattr(c, "rope_scaling", None) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise UnsupportedModelError(
                "this config uses rope_scaling, which the local HookedTransformer path does not convert",
                remedy="use the bridge backend (--backend bridge)",
            )
    d["original_architecture"] = arch
    return d


def hooked_from_hf(hf_model: Any, tokenizer: Any, *, name: str = "local", processing: bool = True,
                   device: str | None = None) -> Any:
    """A HookedTransformer with the weights of `hf_model` (TransformerLens's converters and processing)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained import weight_conversions as wc

    cfg_dict = hooked_config_dict(hf_model.config)
    dtype = next(hf_model.parameters()).dtype
    cfg = HookedTransformerConfig(
        **cfg_dict, model_name=name, dtype=dtype, device=device or "cpu",
        default_prepend_bos=True, tokenizer_prepends_bos=False,
    )
    convert = {
        "GPT2LMHeadModel": wc.convert_gpt2_weights,
        "GPTNeoXForCausalLM": wc.convert_neox_weights,
        "LlamaForCausalLM": wc.convert_llama_weights,
        "Qwen2ForCausalLM": wc.convert_qwen2_weights,
        "MistralForCausalLM": wc.convert_mistral_weights,
    }[cfg_dict["original_architecture"]]
    with torch.no_grad():
        state_dict = convert(hf_model, cfg)
    model = HookedTransformer(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict, fold_ln=processing, center_writing_weights=processing, center_unembed=processing,
        fold_value_biases=processing, refactor_factored_attn_matrices=False,
    )
    return model.to(device or "cpu").eval()
