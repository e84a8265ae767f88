"""The logit lens's maths: taking an activation to the vocabulary.

Residual-stream states (resid_pre, resid_mid, resid_post) are decoded as the model decodes its
last one: final norm with its statistics RECOMPUTED on that state, then W_U and b_U
(TransformerLens's `accumulated_resid(apply_ln=True)` convention; nostalgebraist 2020).

Components (embed, pos_embed, attn_out, mlp_out, per-head result; z, v and mlp_post taken to the
residual basis through W_O / W_out) are decoded with the final norm's scale FROZEN, without
biases: logits = centre(c) / scale * w_norm @ W_U. Which scale is `component_scale`:
  "residual" (default)  the scale the final norm would compute on the full residual stream right
                        after the component is added (resid_mid/resid_post of its layer; resid_pre.0
                        for embeddings): the component's share of that layer's lens logits.
  "final"               the scale of the model's final residual stream (TransformerLens's
                        apply_ln_to_stack, the direct-logit-attribution convention): the component's
                        direct contribution to the output logits.
  "recompute"           the final norm applied to the component alone (its own statistics).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..errors import SiteError
from ..models.adapter import ModelAdapter
from ..models.names import ActName

ComponentScale = Literal["residual", "final", "recompute"]
RESIDUAL_STATES = ("resid_pre", "resid_mid", "resid_post")
COMPONENTS = ("embed", "pos_embed", "attn_out", "mlp_out", "result", "z", "v", "mlp_post")


def check_lens_kind(kind: str, post_norms: bool = False) -> None:
    if kind not in RESIDUAL_STATES + COMPONENTS:
        raise SiteError(f"{kind} is not in the residual basis and has no map to it", code="lens_not_in_residual_basis",
                        remedy="lens reads resid_pre/mid/post, embed, pos_embed, attn_out, mlp_out, result, "
                        "and z, v, mlp_post (taken through W_O / W_out)")
    if post_norms and kind in ("z", "v", "mlp_post"):  # W_O / W_out alone miss the norm after them (Gemma 2/3)
        raise SiteError(f"{kind} reaches the residual stream through a norm after attention / the MLP on this "
                        "family, which W_O / W_out alone do not apply", code="lens_through_post_norm",
                        remedy="decode result (heads through the post-norm with its scale frozen), attn_out or mlp_out")


def residual_after(model: ModelAdapter, kind: str, layer: int | None) -> ActName:
    """The full residual stream right after a component of `kind` at `layer` is added."""
    if kind in ("embed", "pos_embed"):
        return ActName("resid_pre", 0)
    if kind == "mlp_out" or model.structure.parallel:
        return ActName("resid_post", layer)
    if kind == "mlp_post":
        return ActName("resid_post", layer)
    return ActName("resid_mid", layer)


def to_residual_basis(model: ModelAdapter, kind: str, layer: int | None, act: Tensor) -> Tensor:
    """z [.., h, d_head] -> [.., h, d_model] through W_O; v [.., kv, d_head] -> per query head through
    W_O (query head h reads kv head h // group); mlp_post [.., n] -> [.., n, d_model] through W_out."""
    w = model.weights
    if kind == "z":
        return torch.einsum("...hd,hdm->...hm", act, w.W_O(layer).to(act.dtype))
    if kind == "v":
        per_q = act.repeat_interleave(model.structure.group_size, dim=-2)
        return torch.einsum("...hd,hdm->...hm", per_q, w.W_O(layer).to(act.dtype))
    if kind == "mlp_post":
        return act.unsqueeze(-1) * w.W_out(layer).to(act.dtype)
    return act


def decode_states(model: ModelAdapter, x: Tensor) -> Tensor:
    """Residual states [..., d_model] -> logits [..., d_vocab] (norm recomputed, biases included)."""
    w = model.weights
    return w.final_norm(x) @ w.W_U + w.b_U


def decode_components(model: ModelAdapter, c: Tensor, scale: Tensor | None) -> Tensor:
    """Components [..., d_model] -> logits; `scale` [..., 1] frozen, or None to recompute the norm."""
    w = model.weights
    if scale is None:
        return w.final_norm(c) @ w.W_U + w.b_U
    return w.final_norm.linear_part(c, scale) @ w.W_U
