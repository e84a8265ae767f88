"""Small synthetic .gguf files for tests, written with the `gguf` package from a tiny random HuggingFace model.

`write_llama_gguf(path, ...)` writes a tiny Llama (models/tiny.py's shape: 64 wide, 4 query heads sharing 2
key/value heads) with the tiny byte-level BPE tokenizer, in float32, under llama.cpp's tensor and key names;
q and k are stored permuted as llama.cpp's converter stores them (transformers undoes the permutation on read),
so the dequantized model equals the source model. `drop` leaves tensors out (a damaged file).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _llama_cpp_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotary halves interleaved per head, the order llama.cpp stores q and k in (transformers reverses it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors_of(model) -> dict[str, np.ndarray]:
    """A HuggingFace Llama's weights under llama.cpp's names, q and k in llama.cpp's order."""
    cfg = model.config
    out = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module == "self_attn.q_proj":
                w = _llama_cpp_order(w, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = _llama_cpp_order(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{_BLOCK[module]}.{kind}"] = w
    return out


def write_llama_gguf(path: str | Path, *, seed: int = 0, name: str | None = "Tiny Llama Test",
                     drop: tuple[str, ...] = (), architecture: str = "llama", model=None) -> Path:
    """A tiny Llama .gguf at `path` (float32 tensors); the HuggingFace model it was written from is
    `models.tiny.tiny_hf_model("llama", seed)` unless `model` is given. `drop`: tensor-name prefixes left out."""
    import gguf

    from entoscope.models.tiny import tiny_hf_model, tokenizer_dir

    model = model if model is not None else tiny_hf_model("llama", seed)
    cfg = model.config
    tok = json.loads((Path(tokenizer_dir()) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(len(tokens))) and len(tokens) == cfg.vocab_size
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), architecture)
    if name is not None:
        w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    for key, value in tensors_of(model).items():
        if not key.startswith(drop):
            w.add_tensor(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_mamba_gguf(path: str | Path) -> Path:
    """A tiny Mamba (a state-space model: no attention, no positions) as a .gguf transformers can read."""
    import gguf
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    from entoscope.models.tiny import tokenizer_dir

    tok = json.loads((Path(tokenizer_dir()) / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=len(tokens), hidden_size=32, state_size=4, num_hidden_layers=2,
                                         conv_kernel=4, expand=2, time_step_rank=4, bos_token_id=0, eos_token_id=0,
                                         pad_token_id=0))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA, 2)
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_name("Tiny Mamba")
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(4)
    w.add_ssm_time_step_rank(4)
    w.add_ssm_inner_size(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    for name, p in model.state_dict().items():
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if key is None:  # lm_head tied to the embedding
            continue
        x = p.detach().float().numpy().copy()
        if "conv1d.weight" in name:  # llama.cpp stores [inner, kernel]; transformers adds the middle axis back
            x = x.squeeze(1)
        if name.endswith("A_log"):  # llama.cpp stores A = -exp(A_log)
            x = -np.exp(x)
        w.add_tensor(key, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
