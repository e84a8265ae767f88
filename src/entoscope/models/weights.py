"""The weights operations need, in one layout whatever the backend.

Per-head matrices are indexed by QUERY head: under grouped-query attention, W_K/W_V/b_K/b_V are
expanded so that query head h reads key/value head h // group_size (HuggingFace's repeat_kv and
TransformerLens's repeat_interleave agree on this). The unexpanded matrices are W_K_kv/W_V_kv.
Missing biases (Llama has none) are zeros, so formulas need no special cases.

Family conventions (docs/families.md; the values come from the structure record, read from the family table):
- W_E is the embedding TABLE (a view of the parameter, as TransformerLens's W_E). What enters the residual
  stream, and what the `embed` site holds, is `embedding(tokens)` = W_E[tokens] * structure.embed_scale
  (Gemma: sqrt(d_model)), so resid_pre.0 = embed (+ pos_embed) on every family.
- A norm's `weight` is its GAIN, what multiplies the normalised vector: Gemma's RMSNorm computes
  x / rms * (1 + weight), so there the Norm's weight is 1 + the parameter (structure.norm_offset).
- `post_norm(layer, "attn" | "mlp")`: the norm applied to a block's attention / MLP output before it is
  added to the residual (Gemma 2/3), None elsewhere; attn_out and mlp_out are what is ADDED (post-normed).

Shapes: W_E [d_vocab, d_model], W_pos [n_ctx, d_model], W_U [d_model, d_vocab], b_U [d_vocab],
W_Q/W_K/W_V [n_heads, d_model, d_head], b_Q/b_K/b_V [n_heads, d_head],
W_O [n_heads, d_head, d_model], b_O [d_model], W_in/W_gate [d_model, d_mlp], b_in [d_mlp],
W_out [d_mlp, d_model], b_out [d_model].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import SiteError
from .structure import Structure


@dataclass(frozen=True)
class Norm:
    """A LayerNorm or RMSNorm as a callable, with its parameters.

    `weight`/`bias` are None when folded away (the model then applies only the centring (LayerNorm)
    and the division by the scale). `__call__(x, scale=s)` divides by a given scale instead of
    recomputing it: that is how a frozen scale is applied to one component of a sum.
    """

    kind: str  # "layernorm" | "rmsnorm"
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def center(self, x: Tensor) -> Tensor:
        return x - x.mean(-1, keepdim=True) if self.kind == "layernorm" else x

    def scale(self, x: Tensor) -> Tensor:
        """The norm's scale for each position: [..., 1]."""
        xc = self.center(x)
        return (xc.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def __call__(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        y = self.center(x) / (self.scale(x) if scale is None else scale)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y

    def linear_part(self, x: Tensor, scale: Tensor) -> Tensor:
        """The part of the norm that is linear in x once the scale is frozen (no bias)."""
        y = self.center(x) / scale
        return y * self.weight if self.weight is not None else y


def _zeros_like_bias(shape: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


class Weights:
    """Read-only access to a model's weights (views: they reflect later changes to the model)."""

    def __init__(self, tl: Any, structure: Structure) -> None:
        self._tl = tl
        self.s = structure

    # --- embeddings and unembedding ---
    @property
    def W_E(self) -> Tensor:
        return self._tl.W_E

    def embedding(self, tokens: Tensor | int) -> Tensor:
        """What token ids put into the residual stream: W_E[tokens] * embed_scale ([..., d_model])."""
        rows = self.W_E[tokens]
        return rows * self.s.embed_scale if self.s.embed_scale != 1.0 else rows

    @property
    def W_pos(self) -> Tensor:
        if self.s.positional != "learned":
            raise SiteError(f"this model has {self.s.positional} positions: there is no W_pos",
                            remedy="positional information enters through q and k (rotary)",
                            code="no_learned_positions")
        if hasattr(self._tl, "W_pos"):
            return self._tl.W_pos
        return self._tl.pos_embed.weight if hasattr(self._tl.pos_embed, "weight") else \
            self._tl.pos_embed.original_component.weight

    @property
    def W_U(self) -> Tensor:
        return self._tl.W_U

    @property
    def b_U(self) -> Tensor:
        try:
            b = self._tl.b_U
        except (AttributeError, TypeError):
            b = None
        return b if b is not None else _zeros_like_bias((self.s.d_vocab,), self.W_U)

    # --- attention ---
    def _attn(self, layer: int) -> Any:
        return self._tl.blocks[layer].attn

    def _get(self, module: Any, name: str) -> Tensor | None:
        try:
            return getattr(module, name)
        except (AttributeError, TypeError):
            return None

    def _per_query_head(self, t: Tensor) -> Tensor:
        if t.shape[0] == self.s.n_heads:
            return t
        if t.shape[0] == self.s.n_kv_heads:
            return t.repeat_interleave(self.s.group_size, dim=0)
        raise AssertionError(f"unexpected head axis {t.shape[0]}")

    def W_Q(self, layer: int) -> Tensor:
        return self._attn(layer).W_Q

    def b_Q(self, layer: int) -> Tensor:
        b = self._get(self._attn(layer), "b_Q")
        return b if b is not None else _zeros_like_bias((self.s.n_heads, self.s.d_head), self.W_Q(layer))

    def W_K_kv(self, layer: int) -> Tensor:
        """Keys per key/value head: [n_kv_heads, d_model, d_head]."""
        attn = self._attn(layer)
        raw = self._get(attn, "_W_K")
        return raw if raw is not None else attn.W_K[:: 1 if attn.W_K.shape[0] == self.s.n_kv_heads else self.s.group_size]

    def W_V_kv(self, layer: int) -> Tensor:
        attn = self._attn(layer)
        raw = self._get(attn, "_W_V")
        return raw if raw is not None else attn.W_V[:: 1 if attn.W_V.shape[0] == self.s.n_kv_heads else self.s.group_size]

    def W_K(self, layer: int) -> Tensor:
        return self._per_query_head(self._attn(layer).W_K)

    def W_V(self, layer: int) -> Tensor:
        return self._per_query_head(self._attn(layer).W_V)

    def b_K(self, layer: int) -> Tensor:
        b = self._get(self._attn(layer), "b_K")
        return self._per_query_head(b) if b is not None else \
            _zeros_like_bias((self.s.n_heads, self.s.d_head), self.W_Q(layer))

    def b_V(self, layer: int) -> Tensor:
        b = self._get(self._attn(layer), "b_V")
        return self._per_query_head(b) if b is not None else \
            _zeros_like_bias((self.s.n_heads, self.s.d_head), self.W_Q(layer))

    def W_O(self, layer: int) -> Tensor:
        return self._attn(layer).W_O

    def b_O(self, layer: int) -> Tensor:
        b = self._get(self._attn(layer), "b_O")
        return b if b is not None else _zeros_like_bias((self.s.d_model,), self.W_O(layer))

    def OV(self, layer: int) -> Tensor:
        """The OV circuit of each query head: W_V[h] @ W_O[h], [n_heads, d_model, d_model]."""
        return self.W_V(layer) @ self.W_O(layer)

    # --- MLP ---
    def _mlp(self, layer: int) -> Any:
        return self._tl.blocks[layer].mlp

    def W_in(self, layer: int) -> Tensor:
        return self._mlp(layer).W_in

    def b_in(self, layer: int) -> Tensor:
        b = self._get(self._mlp(layer), "b_in")
        return b if b is not None else _zeros_like_bias((self.s.d_mlp,), self.W_in(layer))

    def W_gate(self, layer: int) -> Tensor | None:
        return self._get(self._mlp(layer), "W_gate") if self.s.gated_mlp else None

    def W_out(self, layer: int) -> Tensor:
        return self._mlp(layer).W_out

    def b_out(self, layer: int) -> Tensor:
        b = self._get(self._mlp(layer), "b_out")
        return b if b is not None else _zeros_like_bias((self.s.d_model,), self.W_out(layer))

    # --- norms ---
    def norm(self, layer: int, which: str) -> Norm:
        """`which` is "ln1" (before attention) or "ln2" (before the MLP)."""
        return self._norm(getattr(self._tl.blocks[layer], which))

    def post_norm(self, layer: int, which: str) -> Norm | None:
        """The norm after the attention ("attn") or the MLP ("mlp") of `layer`, None without post-norms.
        Never folded (TransformerLens folds only the norms that feed a matrix)."""
        if not self.s.post_norms:
            return None
        return self._norm(getattr(self._tl.blocks[layer], "ln1_post" if which == "attn" else "ln2_post"), post=True)

    @property
    def final_norm(self) -> Norm:
        return self._norm(self._tl.ln_final)

    def _norm(self, module: Any, post: bool = False) -> Norm:
        kind = self.s.norm
        if self.s.norm_folded and not post:
            return Norm(kind, None, None, self._eps(module))
        inner = getattr(module, "original_component", None) or module
        weight = getattr(inner, "weight", None)
        if weight is None:
            weight = getattr(inner, "w", None)
        bias = getattr(inner, "bias", None)
        if bias is None and kind == "layernorm":
            bias = getattr(inner, "b", None)
        if weight is not None and self.s.norm_offset:
            weight = weight + self.s.norm_offset  # the gain: Gemma's (1 + weight)
        return Norm(kind, weight, bias, self._eps(module))

    def _eps(self, module: Any) -> float:
        inner = getattr(module, "original_component", None) or module
        for attr in ("eps", "variance_epsilon"):
            value = getattr(inner, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
        return float(self._tl.cfg.eps)
