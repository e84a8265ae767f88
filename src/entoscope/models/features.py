"""Feature sites in the model layer: a dictionary's features, read by encoding and written by decoding.

An activation `features.L@KEY` is the feature activations of dictionary KEY (an SAE or a transcoder,
entoscope.dictionaries) at the site it writes, layer L. Reading it encodes the dictionary's input
activation. Writing it (patching, ablation, steering: any Intervention on it) replaces the written
activation x_out by

    x_out + (f_new - f) @ W_dec  =  decode(f_new) + error,   error = x_out - decode(f),  f = encode(x_in)

so the dictionary's error term is kept, and with f_new == f the activation is bit-exactly the model's
own. The intervention receives f detached from the model's graph: a gradient with respect to it (as
attribution patching takes) is W_dec @ dm/dx_out, the effect of moving one feature with the error held
fixed, and the model's own gradient paths are not changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from ..errors import DictionaryError, SiteError
from .names import ActName, parse_name

if TYPE_CHECKING:
    from .dictionaries.dictionary import Dictionary
    from .adapter import ModelAdapter

_SPACE_OF_MODE = {"plain": "plain", "unprocessed": "plain", "compat": "processed", "processed": "processed"}
READABLE_SPACES = ("d_model", "neuron")  # last axis of a kind a dictionary may read or write


def dictionary(act: ActName) -> Dictionary:
    from .dictionaries.catalog import get_dictionary

    if act.basis is None:
        raise SiteError(f"{act} names no dictionary", code="features_name",
                        remedy="write features.LAYER@DICTIONARY, or give Sites(dictionary=...)")
    return get_dictionary(act.basis)


def resolve(model: ModelAdapter, act: ActName) -> ActName:
    """Check that the dictionary fits this model at this layer; the canonical features name."""
    d = dictionary(act)
    hook_in, hook_out = model.resolve(d.hook_in), model.resolve(d.hook_out)
    if hook_out.layer is None or act.layer != hook_out.layer:
        raise SiteError(f"{act}: dictionary {act.basis!r} writes {hook_out}, not a site of layer {act.layer}",
                        code="dictionary_site_mismatch", remedy=f"use features.{hook_out.layer}@{act.basis}")
    for role, name, size in (("reads", hook_in, d.d_in), ("writes", hook_out, d.d_out)):
        axes = name.spec.axes
        if len(axes) != 2 or axes[0] != "pos" or axes[1] not in READABLE_SPACES:
            raise DictionaryError(f"dictionary {act.basis!r} {role} {name}, which is not one vector per token",
                                  code="dictionary_site_unsupported",
                                  remedy="use dictionaries on residual, attention-output, MLP or neuron activations")
        width = model.axis_sizes(name.kind)[axes[1]]
        if width != size:
            raise DictionaryError(f"dictionary {act.basis!r} {role} {name} with width {size}, but this model's "
                                  f"{name} has width {width}", code="dictionary_shape_mismatch",
                                  remedy="use a dictionary trained on this model")
        model.hook_name(name)  # refuses what this backend cannot serve
    space = space_of(model)
    if d.space not in ("any", space):
        raise DictionaryError(
            f"dictionary {act.basis!r} was trained on {d.space} activations, and this model gives {space} ones "
            f"({model.structure.backend}, {model.structure.mode})", code="dictionary_space_mismatch",
            remedy="load the model the way the dictionary was trained (processed: a HookedTransformer or a bridge in "
            "compatibility mode; plain: a plain TransformerBridge), or set the dictionary's space to 'any'")
    return ActName("features", act.layer, act.basis)


def space_of(model: ModelAdapter) -> str:
    """The activation space a model gives: "plain" (HuggingFace's numbers) or "processed" (TransformerLens's)."""
    return _SPACE_OF_MODE[model.structure.mode]


def source(act: ActName) -> ActName:
    """The activation a feature read encodes."""
    return parse_name(dictionary(act).hook_in)


def encode(act: ActName, x_in: Tensor) -> Tensor:
    return dictionary(act).encode(x_in)


def interventions(act: ActName, fn: Callable[[Tensor], Tensor]) -> list[tuple[ActName, Callable]]:
    """Interventions at the dictionary's sites that write `fn(features)`, keeping its error term."""
    d = dictionary(act)
    hook_in, hook_out = parse_name(d.hook_in), parse_name(d.hook_out)

    def write(x_out: Tensor, x_in: Tensor) -> Tensor:
        f = d.encode(x_in).detach()
        return d.write(x_out, f, fn(f))

    if hook_in == hook_out:
        return [(hook_out, lambda x: write(x, x))]
    stash: dict[str, Tensor] = {}

    def keep(x: Tensor) -> None:
        stash["x_in"] = x

    def edit(x: Tensor) -> Tensor:
        return write(x, stash.pop("x_in"))
    return [(hook_in, keep), (hook_out, edit)]


def width(act: ActName) -> int:
    return dictionary(act).d_sae
