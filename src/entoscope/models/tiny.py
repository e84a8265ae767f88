"""Tiny random models of each family, built offline from configs in well under a second.

Used by the test suite (and by anyone writing an operation: every operation runs on all of them).
Families: "gpt2" (LayerNorm, learned positions, Conv1D weights), "neox" (parallel attention+MLP,
partial rotary), "llama" (RMSNorm, rotary, gated MLP, grouped-query attention: 4 query heads
sharing 2 key/value heads). "gemma3" and "gemma2" (GEMMA_FAMILIES: not in the suite-wide FAMILIES, their own
tests in tests/test_gemma.py) carry every Gemma trait: (1 + weight) norms, a scaled embedding, norms
after attention and the MLP, 4 query heads sharing 1 key/value head, a sliding window of 4 on layer 0,
query_pre_attn_scalar; Gemma 3 q/k norms, Gemma 2 attention and final-logit soft caps. Variants: backend "bridge" (plain or compat) or "hooked"; "nnsight" builds
an nnsight LanguageModel around the same HuggingFace model (same seed: the same weights as the bridge's).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("gpt2", "neox", "llama")
GEMMA_FAMILIES = ("gemma3", "gemma2")
VARIANTS = (("bridge", False), ("bridge", True), ("hooked", False))

_CORPUS = [
    "When Mary and John went to the store, John gave a drink to Mary.",
    "The capital of France is Paris. The capital of Spain is Madrid.",
    "The war lasted from the year 1732 to the year 1789.",
    "one two three four five six seven eight nine ten one two three four five",
]


@functools.lru_cache(maxsize=1)
def tokenizer_dir() -> str:
    """A small byte-level BPE tokenizer saved to a temporary folder (BOS/EOS/PAD id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    folder = Path(tempfile.mkdtemp(prefix="entoscope_tiny_tok_"))
    fast.save_pretrained(str(folder))
    return str(folder)


def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


def tiny_hf_model(family: str, seed: int = 0, n_layers: int = 2) -> Any:
    """A random HuggingFace causal LM of the family (eager attention, eval mode)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                              LlamaConfig, LlamaForCausalLM)

    vocab = len(tiny_tokenizer())
    common = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=n_layers, n_embd=64, n_head=4, n_positions=64, vocab_size=vocab, **common)
        model = GPT2LMHeadModel(cfg)
    elif family == "neox":
        cfg = GPTNeoXConfig(num_hidden_layers=n_layers, hidden_size=64, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=64, vocab_size=vocab,
                            use_parallel_residual=True, rotary_pct=0.5, **common)
        model = GPTNeoXForCausalLM(cfg)
    elif family == "llama":
        cfg = LlamaConfig(num_hidden_layers=n_layers, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                          vocab_size=vocab, **common)
        model = LlamaForCausalLM(cfg)
    elif family in GEMMA_FAMILIES:
        model = _tiny_gemma(family, vocab, n_layers, common)
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES + GEMMA_FAMILIES}")
    # Random init leaves norms at weight 1, bias 0; perturb them so folding is really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


def _tiny_gemma(family: str, vocab: int, n_layers: int, common: dict[str, Any]) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    types = ["sliding_attention" if L % 2 == 0 else "full_attention" for L in range(n_layers)]
    shape = dict(num_hidden_layers=n_layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=16, intermediate_size=128, max_position_embeddings=64, vocab_size=vocab, sliding_window=4,
                 query_pre_attn_scalar=24, layer_types=types, **common)
    if family == "gemma3":
        cfg = Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **shape)
        cls = Gemma3ForCausalLM
    else:
        cfg = Gemma2Config(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=5.0,
                           final_logit_softcapping=3.0, **shape)
        cls = Gemma2ForCausalLM
    cfg._attn_implementation = "eager"  # output_attentions (the tests' reference) needs it at construction
    model = cls(cfg)
    with torch.no_grad():  # random init leaves Gemma's norm weights at 0 (gain 1): the perturbation below
        model.model.embed_tokens.weight.mul_(4.0)  # and scores large enough to reach the soft caps
    return model


def tiny_model(family: str = "gpt2", backend: str = "bridge", compat: bool = False, seed: int = 0,
               n_layers: int = 2) -> Any:
    """A tiny random model of `family` as a TransformerLens object on the chosen backend."""
    from .loading import from_hf

    return from_hf(tiny_hf_model(family, seed, n_layers), tiny_tokenizer(), backend=backend,  # type: ignore[arg-type]
                   compat=compat, name=f"tiny-{family}", folder=tokenizer_dir())
