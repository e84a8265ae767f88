"""The structure record: what every operation needs to know about a model's shape and layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Structure:
    """Shape and layout of a model, the same fields whatever the backend.

    norm_folded: True when the norms' weights were folded into the next linear maps (a
    HookedTransformer with TransformerLens's processing, or a bridge in compatibility mode): then
    the normalised activations (attn_in, mlp_in) carry no learned scale, and writing weights are
    centred. Numbers read at those sites mean something different from a plain bridge's.

    The family fields (defaults: a plain pre-norm decoder; values from the family table, hf_families.py;
    conventions in docs/families.md):
    norm_offset    every norm's gain is norm_offset + weight (Gemma: 1)
    embed_scale    embed = W_E[token] * embed_scale (Gemma: sqrt(d_model)); resid_pre.0 = embed
    post_norms     a norm after attention and after the MLP (Gemma 2/3): attn_out and mlp_out are the
                   post-normed outputs, what is added to the residual stream
    qk_norm        per-head norms of q and k before rotary (Gemma 3); the q and k sites are before them
    attn_scale     what q.k is divided by (sqrt(d_head), or Gemma's sqrt(query_pre_attn_scalar))
    attn_softcap, final_softcap   tanh caps: c * tanh(x / c) on attention scores / logits (Gemma 2), or None
    sliding_window, sliding_layers   the layers whose queries see only the last sliding_window keys
    """

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    norm: Literal["layernorm", "rmsnorm"]
    norm_folded: bool
    positional: Literal["learned", "rotary"]
    parallel: bool
    gated_mlp: bool
    act_fn: str
    backend: Literal["bridge", "hooked"]
    mode: Literal["plain", "compat", "processed", "unprocessed"]
    tied_embeddings: bool
    quantization: str | None = None  # weights read from a quantized file (GGUF) and dequantized: not the checkpoint
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    post_norms: bool = False
    qk_norm: bool = False
    attn_scale: float = 0.0  # 0: sqrt(d_head)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON reads it back (tuples as lists), so a manifest equals the record it saved."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def describe(self) -> str:
        """A few human lines (the `entoscope info` printout)."""
        gqa = f" ({self.n_kv_heads} key/value heads)" if self.n_kv_heads != self.n_heads else ""
        return "\n".join([
            f"architecture   {self.architecture}  [{self.backend}, {self.mode}]",
            f"layers         {self.n_layers}, {'parallel' if self.parallel else 'sequential'} attention+MLP",
            f"heads          {self.n_heads}{gqa}, d_head {self.d_head}",
            f"d_model        {self.d_model}, d_mlp {self.d_mlp} ({'gated' if self.gated_mlp else 'plain'} "
            f"{self.act_fn})",
            f"vocabulary     {self.d_vocab}, context {self.n_ctx}, "
            f"{'tied' if self.tied_embeddings else 'untied'} embeddings",
            f"norm           {self.norm}{' (folded)' if self.norm_folded else ''}, "
            f"{self.positional} positions",
            *self._family_lines(),
        ] + ([f"weights        dequantized from {self.quantization} to float32 (not the original checkpoint)"]
             if self.quantization else []))

    def _family_lines(self) -> list[str]:
        """What this family does beyond a plain pre-norm decoder (nothing for GPT-2, NeoX, Llama)."""
        out = []
        if self.norm_offset:
            out.append(f"norm gain      ({self.norm_offset:g} + weight)")
        if self.embed_scale != 1.0:
            out.append(f"embed scale    {self.embed_scale:.4g} (embed = W_E[token] * scale)")
        if self.post_norms or self.qk_norm:
            out.append("extra norms    " + ", ".join(
                [*(["after attention and after the MLP (attn_out, mlp_out post-normed)"] if self.post_norms else []),
                 *(["q and k per head"] if self.qk_norm else [])]))
        if self.attn_scale and abs(self.attn_scale - self.d_head ** 0.5) > 1e-9:
            out.append(f"attn scale     q.k / {self.attn_scale:.4g}")
        if self.attn_softcap or self.final_softcap:
            out.append(f"soft caps      attention {self.attn_softcap or 'none'}, logits {self.final_softcap or 'none'}")
        if self.sliding_window:
            out.append(f"sliding window {self.sliding_window} on {len(self.sliding_layers)} of {self.n_layers} layers")
        return out
