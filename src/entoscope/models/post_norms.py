"""The post-norm convention, in one place: how a component's output is carried through the norm a family
applies AFTER attention or the MLP (Gemma 2/3: attn_out = post_ln1(o_proj(z)), mlp_out = post_ln2(mlp(x))).

A post-norm is not linear in its input, so a sum of components (the heads of a layer, the neurons of an
MLP) cannot be carried through it as it is. Every decomposition in entoscope freezes the post-norm's scale
at the run being decomposed (its own `ln1_post_scale` / `ln2_post_scale`, read from the model), exactly as
DLA freezes the final norm's scale (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits"; TransformerLens's apply_ln_to_stack). Then, for RMSNorm post-norms with gain g = 1 + weight:

    head h's contribution to the residual   result_h = (z_h @ W_O[h]) * g / s_attn
    the attention bias part                 b_O * g / s_attn     (zero on Gemma: no bias)
    neuron n's contribution                 mlp_post[n] * W_out[n] * g_mlp / s_mlp

and sum_h result_h + bias part = attn_out (the post-normed output, what is added to the residual stream)
exactly, as the neurons plus theirs = mlp_out. s is the scale of THIS run (a corrupted run's heads are
carried through the corrupted run's scale). Derivatives taken through `result` (attribution, EAP) hold the
scale fixed, as they hold the final norm's where they are taken at the residual stream.

On a family without post-norms every function here is the identity (no scale read, nothing multiplied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .names import ActName
from .structure import Structure

if TYPE_CHECKING:
    from .adapter import ModelAdapter


def post_scale_reads(structure: Structure, layer: int, which: str) -> list[ActName]:
    """The post-norm scale a decomposition of `layer`'s attention ("attn") or MLP ("mlp") output reads ([] without)."""
    if not structure.post_norms:
        return []
    return [ActName("ln1_post_scale" if which == "attn" else "ln2_post_scale", layer)]


def through_post_norm(model: ModelAdapter, layer: int, which: str, x: Tensor, scale: Tensor | None = None) -> Tensor:
    """x (a component's raw output, [..., d_model]) as it reaches the residual stream: the post-norm's linear
    part with `scale` frozen (broadcast against x), or x itself without a post-norm."""
    norm = model.weights.post_norm(layer, which) if model.structure.post_norms else None
    if norm is None:
        return x
    if scale is None:
        raise AssertionError(f"the {which} post-norm scale of layer {layer} was not read")
    return norm.linear_part(x, scale.to(x.dtype)).to(x.dtype)


def head_outputs(model: ModelAdapter, layer: int, z: Tensor, scale: Tensor | None) -> Tensor:
    """Each head's contribution to the residual stream, [B, T, H, d_model], from z [B, T, H, d_head] and
    (post-norm families) the run's post-attention scale [B, T, 1]."""
    result = torch.einsum("bphd,hdm->bphm", z, model.weights.W_O(layer).to(z.dtype))
    return through_post_norm(model, layer, "attn", result, None if scale is None else scale[:, :, None])
