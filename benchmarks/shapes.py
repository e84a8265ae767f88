"""Real models' shapes with random weights, built offline from their published configurations (nothing downloaded).

    from shapes import build, SHAPES
    model = build("llama-3.2-1b", "bfloat16")            # a TransformerBridge, on the CPU
    model = build("gemma-2-2b", "bfloat16", device="cuda")  # built on the device: no file travels

    python benchmarks/shapes.py                          # each shape's parameters and weight bytes per dtype
    python benchmarks/shapes.py llama-3.2-1b bfloat16    # build one and run one forward (time, memory)

The configurations are the published `config.json` of each model (the numbers that set the memory and time of
a run: layers, widths, heads, key/value heads, head size, vocabulary, soft caps, sliding windows, tied
embeddings); the weights are HuggingFace's random initialisation, so the logits mean nothing and the
memory and the time are the real model's. The tokenizer is SmolLM2-135M's where the real-model cache holds it
(`build`), else the test suite's tiny byte-level one.

Sizes (parameters; weights in float32 / bfloat16): SmolLM2-135M 135M (0.54 / 0.27 GB), Gemma 3 270M 268M
(1.07 / 0.54 GB), Qwen2.5 0.5B 494M (1.98 / 0.99 GB), Llama 3.2 1B 1.24B (4.94 / 2.47 GB), Gemma 2 2B 2.61B
(10.5 / 5.2 GB). On the shared 24 GB benchmark machine the 2B shape in float32 (and the 1B in float32) runs only
under `/work/bin/heavy --big`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

# name -> (transformers config class name, the published configuration's fields that shape a run)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True)),
    # google/gemma-3-270m
    "gemma-3-270m": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"])),
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True)),
    # google/gemma-2-2b
    "gemma-2-2b": ("Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                   for i in range(26)],
        tie_word_embeddings=True, architectures=["Gemma2ForCausalLM"])),
}
ALIASES = {"smollm2": "smollm2-135m", "135m": "smollm2-135m", "gemma3": "gemma-3-270m", "270m": "gemma-3-270m",
           "qwen": "qwen2.5-0.5b", "0.5b": "qwen2.5-0.5b", "llama": "llama-3.2-1b", "1b": "llama-3.2-1b",
           "gemma2": "gemma-2-2b", "2b": "gemma-2-2b"}


def shape_name(name: str) -> str:
    name = ALIASES.get(name.lower(), name.lower())
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return name


def config(name: str) -> Any:
    """The transformers configuration of the named shape (eager attention, the tiny tokenizer's BOS/EOS/PAD)."""
    import transformers

    cls_name, fields = SHAPES[shape_name(name)]
    fields = dict(fields)
    theta = fields.pop("rope_theta", None)
    cfg = getattr(transformers, cls_name)(**fields, **_TOKENS)
    if theta is not None:  # transformers >= 5 keeps rope_theta in rope_parameters
        params = getattr(cfg, "rope_parameters", None)
        if isinstance(params, dict) and "rope_theta" in params:
            params["rope_theta"] = theta
        else:
            cfg.rope_theta = theta
    cfg._attn_implementation = "eager"
    return cfg


def parameters(name: str) -> int:
    """The shape's parameter count (tied embeddings counted once), from the configuration alone."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(name))
    return sum(p.numel() for p in model.parameters())


def hf_model(name: str, dtype: str = "float32", device: str = "cpu", seed: int = 0) -> Any:
    """The named shape as a HuggingFace causal LM with random weights, made on `device` in `dtype` (eval mode).

    The weights are allocated on the device directly and drawn there (HuggingFace's initialisation: normal,
    std = initializer_range, norms at their neutral value), so the largest shape never exists twice."""
    import torch
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config(name), dtype=getattr(torch, dtype))
    model.config._attn_implementation = "eager"
    return model.eval()


def real_tokenizer_folder() -> Path | None:
    """SmolLM2-135M's folder in the real-model cache (scripts/fetch_real_models.py), where it is there."""
    root = Path(os.environ.get("ENTOSCOPE_REAL_MODELS") or Path.home() / ".cache" / "entoscope" / "real-models")
    folder = root / "smollm2-135m"
    return folder if (folder / "tokenizer.json").exists() else None


def build(name: str, dtype: str = "float32", device: str = "cpu", backend: str = "bridge", seed: int = 0) -> Any:
    """The named shape as an entoscope-ready model (a TransformerBridge by default; "hooked", "nnsight").

    Its tokenizer is SmolLM2's where the real-model cache holds it (a real BPE vocabulary of 49,152 ids, inside
    every shape's, so the built-in tasks' names and numbers are single tokens and a prompt is as long as a real
    model's), else the test suite's tiny byte-level one (the tasks that need single-token words refuse there)."""
    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    hf = hf_model(name, dtype, device, seed)
    real = real_tokenizer_folder()
    if real is not None:
        import transformers

        tokenizer, folder = transformers.AutoTokenizer.from_pretrained(str(real)), str(real)
    else:
        tokenizer, folder = tiny_tokenizer(), tokenizer_dir()
    return from_hf(hf, tokenizer, backend=backend, name=shape_name(name),  # type: ignore[arg-type]
                   device=None if device == "cpu" else device, folder=folder)


def weight_bytes(name: str, dtype: str = "float32") -> int:
    return parameters(name) * (2 if dtype in ("bfloat16", "float16") else 4)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main(argv: list[str]) -> int:
    if not argv:
        print(f"{'shape':<14} {'parameters':>12} {'float32 GB':>11} {'bfloat16 GB':>12}")
        for name in SHAPES:
            n = parameters(name)
            print(f"{name:<14} {n:>12,} {4 * n / 1e9:>11.2f} {2 * n / 1e9:>12.2f}")
        return 0
    import torch

    torch.set_num_threads(1)
    name, dtype = argv[0], argv[1] if len(argv) > 1 else "float32"
    t0 = time.perf_counter()
    model = build(name, dtype)
    t1 = time.perf_counter()
    tokens = torch.zeros(1, 16, dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens)
    print(f"{shape_name(name)} {dtype}: built in {t1 - t0:.1f} s, one 16-token forward {time.perf_counter() - t1:.2f} s, "
          f"logits {tuple(logits.shape)}, resident {_rss_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
