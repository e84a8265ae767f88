"""The parameter lens of dictionary features: each feature's decoder row W_dec[i] read through the unembedding.

    DecoderLens(dictionary="demo/transcoder.1", features=[3, 17]).run(model)

A feature adds f_i W_dec[i] to the residual stream (an SAE on resid_post / attn_out / mlp_out, or a
transcoder on mlp_out: all of them write d_model vectors). Its direct logit effect per unit of
activation is, through the final norm with its scale frozen (as DLA, circuits/dla.py), proportional to

    centre(W_dec[i]) * w_norm @ W_U          (`through_norm`, the default)

and raw `W_dec[i] @ W_U` without it (the parameter lens's own convention, lens/parameter.py). With the
norm applied, a plain model (HuggingFace's W_U, the norm weight separate) and a processed one (the
weight folded into W_U, W_U centred) give the same numbers. Scores are per unit of feature activation
and before the 1/scale of the norm, so they rank tokens, and compare features, at one position's scale.
The rows are the parameter lens's: top and bottom tokens with their scores, and the vector's norm.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..errors import DictionaryError
from ..lens.parameter import ParameterLens, ParameterLensState
from ..models.adapter import ModelAdapter
from ..models.names import parse_name
from ..operation import Plan, Prepared, register_operation
from ..sites import Selection, Sites
from ..models.dictionaries.catalog import get_dictionary


def logit_directions(model: ModelAdapter, W_dec: Tensor, through_norm: bool = True) -> Tensor:
    """The residual-stream vectors [F, d_model] whose product with W_U is each feature's logit effect."""
    V = W_dec.to(model.weights.W_U.device, model.weights.W_U.dtype)
    if not through_norm:
        return V
    norm = model.weights.final_norm
    V = norm.center(V)
    return V * norm.weight.to(V.dtype) if norm.weight is not None else V


@register_operation
class DecoderLens(ParameterLens):
    """Dictionary features' decoder rows through the unembedding: the tokens each feature promotes and suppresses.

    dictionary:   one dictionary (demo/transcoder.1, a SAELens folder, a registered name).
    features:     which features ("all", an index, a list, or "a:b").
    through_norm: apply the final norm's centring and weight (scale frozen) before W_U (default true).
    top_k:        tokens listed at each end.
    """

    name = "decoder_lens"
    target: Literal["decoder"] = Field(default="decoder", description="each feature's decoder row")  # type: ignore[assignment]
    space: Literal["unembed"] = Field(default="unembed", description="rows scored through W_U")  # type: ignore[assignment]
    dictionary: str = Field(description="one dictionary: demo/transcoder.1, a SAELens folder, or a registered name")
    features: Selection = Field(default="0:8", description="which features: all, an index, a list, or a range a:b")
    through_norm: bool = Field(default=True, description="apply the final norm's centring and weight (scale frozen) "
                               "before W_U")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[ParameterLensState]:
        d = get_dictionary(self.dictionary)
        kind = d.hook_out.split(".")[0]
        sites = Sites(activation=kind, dictionary=self.dictionary, over=["feature"], features=self.features)
        resolved = sites.resolve(model)  # first: a dictionary of another model is refused as such
        if d.d_out != model.structure.d_model:
            raise DictionaryError(f"dictionary {self.dictionary!r} writes {d.hook_out} (width {d.d_out}), not the "
                                  "residual stream", code="dictionary_site_unsupported",
                                  remedy="read decoder rows of dictionaries that write d_model activations")
        units = [{"dictionary": self.dictionary, "feature": u.get("feature")} for u in resolved.units]
        s = model.structure
        plan = Plan(self.name, rows=len(units), forward_passes=0, backward_passes=0, batch_sizes=[],
                    peak_memory_bytes=4 * len(units) * (s.d_vocab + s.d_model))
        return Prepared(model, data, plan, ParameterLensState(units))

    def reading(self) -> str:
        norm = "centred and scaled by the final norm's weight, its scale frozen" if self.through_norm else \
            "raw, no final norm"
        return f"as decoder rows W_dec[i] through W_U ({norm}; per unit of feature activation)"

    def unit_name(self, row: Any) -> str:
        out = parse_name(get_dictionary(self.dictionary).hook_out)
        return naming.feature(out.kind, out.layer, int(row["feature"]))

    def vectors(self, model: ModelAdapter, units: list[dict[str, Any]]) -> Tensor:
        W_dec = get_dictionary(self.dictionary).W_dec
        return logit_directions(model, W_dec[[u["feature"] for u in units]], self.through_norm)

