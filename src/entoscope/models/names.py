"""Canonical activation names, their axes, and the aliases researchers already use.

A canonical name is `kind.layer` for per-layer activations (`resid_pre.3`, `z.0`) and `kind` for
model-level ones (`embed`, `logits`). Aliases resolve to canonical names:
- TransformerLens hook names: `blocks.5.hook_resid_post`, `blocks.2.attn.hook_z`, `ln_final.hook_scale`;
- nnterp accessors: `layers_output[5]`, `layers_input[5]`, `attentions_output[2]`, `mlps_output[2]`;
- `final_resid` is the last layer's `resid_post` (one tensor, one key: it is never listed twice).
TransformerLens names that mean something entoscope names differently are refused with the
canonical name to use instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnknownNameError


@dataclass(frozen=True)
class Kind:
    """One kind of activation: its axes (after batch) and what it lives in."""

    name: str
    per_layer: bool
    axes: tuple[str, ...]  # axes after the batch axis, e.g. ("pos", "d_model")
    basis: str  # "residual" (d_model, readable through the unembedding), or another space
    doc: str


_KINDS = [
    Kind("embed", False, ("pos", "d_model"), "residual", "token embedding W_E[token]"),
    Kind("pos_embed", False, ("pos", "d_model"), "residual", "learned positional embedding (absent under rotary)"),
    Kind("resid_pre", True, ("pos", "d_model"), "residual", "residual stream entering the block"),
    Kind("resid_mid", True, ("pos", "d_model"), "residual", "residual after attention, before the MLP (sequential blocks only)"),
    Kind("resid_post", True, ("pos", "d_model"), "residual", "residual stream leaving the block"),
    Kind("ln1_scale", True, ("pos", "one"), "scale", "scale (std or RMS) of the norm before attention"),
    Kind("attn_in", True, ("pos", "d_model"), "normalized", "normalised input attention reads (output of ln1)"),
    Kind("q", True, ("pos", "head", "d_head"), "head", "queries, one per query head"),
    Kind("k", True, ("pos", "kv_head", "d_head"), "head", "keys, one per key/value head (grouped-query: fewer than heads)"),
    Kind("v", True, ("pos", "kv_head", "d_head"), "head", "values, one per key/value head"),
    Kind("attn_scores", True, ("head", "query_pos", "key_pos"), "scores", "attention logits before softmax"),
    Kind("pattern", True, ("head", "query_pos", "key_pos"), "pattern", "attention probabilities"),
    Kind("z", True, ("pos", "head", "d_head"), "head", "per-head mixed values (pattern @ v), input to W_O"),
    Kind("result", True, ("pos", "head", "d_model"), "residual", "per-head output in the residual basis (z_h @ W_O[h]; under a post-attention norm, through it with its "
         "scale frozen at the run: docs/families.md); summed with the bias part gives attn_out"),
    Kind("ln1_post_scale", True, ("pos", "one"), "scale", "scale of the norm after attention (post-norm families: "
         "Gemma 2/3)"),
    Kind("attn_out", True, ("pos", "d_model"), "residual", "attention block output added to the residual (post-normed "
         "where the family has a post-attention norm)"),
    Kind("ln2_scale", True, ("pos", "one"), "scale", "scale of the norm before the MLP"),
    Kind("mlp_in", True, ("pos", "d_model"), "normalized", "normalised input the MLP reads (output of ln2)"),
    Kind("mlp_pre", True, ("pos", "neuron"), "neuron", "MLP pre-activation (gated MLP: the gate's pre-activation)"),
    Kind("mlp_post", True, ("pos", "neuron"), "neuron", "MLP neuron activations, the input to W_out"),
    Kind("ln2_post_scale", True, ("pos", "one"), "scale", "scale of the norm after the MLP (post-norm families)"),
    Kind("mlp_out", True, ("pos", "d_model"), "residual", "MLP output added to the residual (post-normed where the "
         "family has a post-MLP norm)"),
    Kind("final_scale", False, ("pos", "one"), "scale", "scale of the final norm"),
    Kind("logits", False, ("pos", "vocab"), "vocab", "output logits"),
    Kind("features", True, ("pos", "feature"), "feature", "a dictionary's feature activations (encode on read; "
         "decode plus the error term on write); named features.L@DICTIONARY"),
]
KINDS: dict[str, Kind] = {k.name: k for k in _KINDS}


@dataclass(frozen=True, order=True)
class ActName:
    """A canonical activation name: a kind and, for per-layer kinds, a layer.

    `basis` names the dictionary of a `features` activation (`features.1@demo/resid_post.1`): the
    activations are that dictionary's features at the site it writes (docs/features.md)."""

    kind: str
    layer: int | None = None
    basis: str | None = None

    def __str__(self) -> str:
        text = self.kind if self.layer is None else f"{self.kind}.{self.layer}"
        return text if self.basis is None else f"{text}@{self.basis}"

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]


# TransformerLens hook suffixes (after `blocks.{L}.`) -> canonical kind.
_TL_BLOCK = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "ln1.hook_scale": "ln1_scale",
    "ln2.hook_scale": "ln2_scale",
    "ln1_post.hook_scale": "ln1_post_scale",
    "ln2_post.hook_scale": "ln2_post_scale",
    "ln1.hook_normalized": "attn_in",
    "ln2.hook_normalized": "mlp_in",
    "ln1.hook_out": "attn_in",
    "ln2.hook_out": "mlp_in",
    "attn.hook_q": "q",
    "attn.hook_k": "k",
    "attn.hook_v": "v",
    "attn.hook_z": "z",
    "attn.hook_result": "result",
    "attn.hook_attn_scores": "attn_scores",
    "attn.hook_pattern": "pattern",
    "mlp.hook_pre": "mlp_pre",
    "mlp.hook_post": "mlp_post",
    "hook_in": "resid_pre",
    "hook_out": "resid_post",
}
_TL_TOP = {
    "hook_embed": "embed",
    "embed.hook_out": "embed",
    "hook_pos_embed": "pos_embed",
    "pos_embed.hook_out": "pos_embed",
    "ln_final.hook_scale": "final_scale",
    "hook_unembed": "logits",
    "unembed.hook_out": "logits",
}
# TransformerLens names whose meaning differs from any one canonical name: say what to use.
_TL_REFUSED = {
    "hook_attn_in": "TransformerLens's hook_attn_in is the pre-norm residual copied per head; use "
    "resid_pre.{L} (pre-norm) or attn_in.{L} (the normalised input attention reads)",
    "hook_mlp_in": "TransformerLens's hook_mlp_in is the pre-norm residual entering the MLP; use "
    "resid_mid.{L} (sequential blocks), resid_pre.{L} (parallel blocks) or mlp_in.{L} (normalised)",
    "hook_q_input": "per-head pre-norm inputs are not a stored activation; use resid_pre.{L} or attn_in.{L}",
    "hook_k_input": "per-head pre-norm inputs are not a stored activation; use resid_pre.{L} or attn_in.{L}",
    "hook_v_input": "per-head pre-norm inputs are not a stored activation; use resid_pre.{L} or attn_in.{L}",
    "attn.hook_rot_q": "rotated queries are not a canonical activation; use q.{L} (before rotation)",
    "attn.hook_rot_k": "rotated keys are not a canonical activation; use k.{L} (before rotation)",
}
_NNTERP = {
    "layers_input": "resid_pre",
    "layers_output": "resid_post",
    "attentions_input": "attn_in",
    "attentions_output": "attn_out",
    "mlps_input": "mlp_in",
    "mlps_output": "mlp_out",
}

_CANON = re.compile(r"^([a-z_0-9]+?)(?:\.(-?\d+))?$")
_TL_BLOCK_RE = re.compile(r"^blocks\.(-?\d+)\.(.+)$")
_NNTERP_RE = re.compile(r"^([a-z_]+)\[(-?\d+)\]$")


def parse_name(name: str | ActName, n_layers: int | None = None) -> ActName:
    """Resolve a canonical name or a known alias to an `ActName`.

    Negative layers count from the end when `n_layers` is given. Layer range is checked by the model
    layer (which knows the model); this function only knows names.
    """
    if isinstance(name, ActName):
        act = name
    else:
        act = _parse(str(name).strip())
    if act.layer is not None and act.layer < 0 and n_layers is not None:
        act = ActName(act.kind, act.layer + n_layers, act.basis)
    return act


def _parse(text: str) -> ActName:
    head, at, basis = text.partition("@")
    if at or head.split(".")[0] == "features":
        if head.split(".")[0] != "features" or not basis.strip():
            raise UnknownNameError(
                f"'{text}': features, and only features, take a dictionary: features.LAYER@DICTIONARY",
                remedy="e.g. features.1@demo/resid_post.1, or give Sites(dictionary=...)", code="features_name")
        return ActName("features", _parse_features(head).layer, basis.strip())
    if text == "final_resid":
        return ActName("resid_post", -1)
    if text in _TL_TOP:
        return ActName(_TL_TOP[text])
    m = _NNTERP_RE.match(text)
    if m and m.group(1) in _NNTERP:
        return ActName(_NNTERP[m.group(1)], int(m.group(2)))
    m = _TL_BLOCK_RE.match(text)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix in _TL_BLOCK:
            return ActName(_TL_BLOCK[suffix], layer)
        for key, why in _TL_REFUSED.items():
            if suffix == key or suffix.endswith("." + key) or suffix == "attn." + key:
                raise UnknownNameError(
                    f"'{text}' cannot be served as one activation: " + why.replace("{L}", str(layer)),
                    remedy="use the canonical name given above",
                    code="alias_unservable",
                )
        raise UnknownNameError(
            f"'{text}' is not a TransformerLens hook entoscope knows",
            remedy=f"use a canonical name: {', '.join(sorted(KINDS))} (with .LAYER where per-layer)",
            code="unknown_activation",
        )
    m = _CANON.match(text)
    if m and m.group(1) in KINDS:
        kind = KINDS[m.group(1)]
        layer = int(m.group(2)) if m.group(2) is not None else None
        if kind.per_layer and layer is None:
            raise UnknownNameError(
                f"'{text}' needs a layer", remedy=f"write it as {text}.LAYER, e.g. {text}.0",
                code="layer_missing",
            )
        if not kind.per_layer and layer is not None:
            raise UnknownNameError(
                f"'{text}' is a model-level activation and takes no layer",
                remedy=f"write it as {kind.name}", code="layer_unexpected",
            )
        return ActName(kind.name, layer)
    raise UnknownNameError(
        f"'{text}' is not an activation name entoscope knows",
        remedy="use a canonical name (" + ", ".join(sorted(KINDS)) + "; with .LAYER where per-layer), "
        "a TransformerLens hook name (blocks.5.hook_resid_post) or an nnterp accessor (layers_output[5])",
        code="unknown_activation",
    )


def _parse_features(head: str) -> ActName:
    m = _CANON.match(head)
    if not m or m.group(2) is None:
        raise UnknownNameError(f"'{head}': a features name needs a layer", code="features_name",
                               remedy="write features.LAYER@DICTIONARY, e.g. features.1@demo/resid_post.1")
    return ActName("features", int(m.group(2)))
