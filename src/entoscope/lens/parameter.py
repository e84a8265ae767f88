"""The parameter lens: weights read in the vocabulary, without running the model.

A weight vector v (in the residual basis) is scored against every token: through W_U
("unembed": v @ W_U, the logits v would add) or through W_E^T ("embed": v @ W_E[t], its
similarity with each token's embedding). Raw dot products: scale and sign are kept, and both the
top and the bottom tokens are reported. Targets:
  neuron_out  W_out[layer][n]        what neuron n writes
  neuron_in   W_in[layer][:, n]      what neuron n reads
  ov          W_E[t] @ W_V[h] @ W_O[h] for each token t in `tokens` (what head h writes when it
              attends to t); without tokens, the head's OV singular directions (output side, scaled
              by the singular value)
  embedding   W_E[t] for each token t in `tokens` (times the family's embedding scale, as it enters the
              residual stream: Weights.embedding; so too in ov)
No final norm is applied. A plain bridge uses HuggingFace's W_U; a compatibility-mode bridge or a
HookedTransformer has the final norm's weight folded into W_U and W_U centred, so the numbers
differ between the two (and for GPT-2, whose W_U is W_E^T, the two spaces agree only on a plain bridge).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..errors import ConfigError
from ..models.adapter import ModelAdapter
from ..operation import Operation, Plan, Prepared, register_operation
from ..results.result import Result
from ..sites import Selection, Sites
from .parameter_takeaway import SPACES, parameter_takeaway


@dataclass(frozen=True)
class ParameterLensState:
    """What the parameter lens's prepare resolved: the units whose weight vectors are projected."""

    units: list[dict[str, Any]]  # {layer, neuron} / {layer, head, token | direction} / {token} / {dictionary, feature}


@register_operation
class ParameterLens(Operation):
    """Weights projected onto the vocabulary (no forward pass).

    target: neuron_out, neuron_in, ov or embedding.   space: unembed (W_U) or embed (W_E^T).
    layers/heads/neurons: which units ("all", an index, a list, or "a:b").
    tokens: input tokens for ov and embedding.   n_singular: OV directions per head without tokens.
    """

    name = "parameter_lens"
    needs_data = False
    target: Literal["neuron_out", "neuron_in", "ov", "embedding"] = Field(default="neuron_out", description="the "
        "weights read: neuron_out (W_out rows), neuron_in (W_in columns), ov (W_E[t] W_V W_O, or the OV singular "
        "directions) or embedding (W_E rows)")
    space: Literal["unembed", "embed"] = Field(default="unembed", description="score against every token through "
                                               "unembed (v @ W_U) or embed (v @ W_E^T)")
    layers: Selection = Field(default="all", description="which layers: all, an index, a list, or a range a:b")
    heads: Selection = Field(default="all", description="which heads (ov): all, an index, a list, or a range a:b")
    neurons: Selection = Field(default="0:8", description="which neurons (neuron_out, neuron_in): all, an index, a "
                               "list, or a range a:b")
    tokens: list[str] | None = Field(default=None, description="input tokens for ov and embedding")
    n_singular: int = Field(default=3, ge=1, description="ov without tokens: the OV singular directions read per "
                            "head")
    top_k: int = Field(default=10, ge=1, description="tokens listed at each end (top and bottom)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[ParameterLensState]:
        s = model.structure
        if self.target == "embedding" and not self.tokens:
            raise ConfigError("target 'embedding' needs tokens", code="tokens_missing",
                              remedy="pass tokens, e.g. tokens: [' Mary', ' Paris']")
        token_ids = [model.token_id(t) for t in self.tokens] if self.tokens else []
        units: list[dict[str, Any]] = []
        if self.target in ("neuron_out", "neuron_in"):
            sites = Sites(activation="mlp_post", over=["layer", "neuron"], layers=self.layers, neurons=self.neurons)
            units = [{"layer": u.get("layer"), "neuron": u.get("neuron")} for u in sites.resolve(model).units]
        elif self.target == "ov":
            sites = Sites(activation="z", over=["layer", "head"], layers=self.layers, heads=self.heads)
            for u in sites.resolve(model).units:
                if token_ids:
                    units += [{"layer": u.get("layer"), "head": u.get("head"), "token": t} for t in token_ids]
                else:
                    units += [{"layer": u.get("layer"), "head": u.get("head"), "direction": i}
                              for i in range(min(self.n_singular, s.d_head))]
        else:
            units = [{"token": t} for t in token_ids]
        plan = Plan(self.name, rows=len(units), forward_passes=0, backward_passes=0, batch_sizes=[],
                    peak_memory_bytes=4 * len(units) * (s.d_vocab + s.d_model))
        return Prepared(model, data, plan, ParameterLensState(units))

    def vectors(self, model: ModelAdapter, units: list[dict[str, Any]]) -> Tensor:
        """The weight vector of each unit, [U, d_model]."""
        w = model.weights
        out = []
        svd_cache: dict[tuple[int, int], Tensor] = {}
        for u in units:
            if self.target == "neuron_out":
                out.append(w.W_out(u["layer"])[u["neuron"]])
            elif self.target == "neuron_in":
                out.append(w.W_in(u["layer"])[:, u["neuron"]])
            elif self.target == "embedding":
                out.append(w.embedding(u["token"]))  # as it enters the residual (Gemma: scaled)
            elif "token" in u:
                out.append(w.embedding(u["token"]) @ w.W_V(u["layer"])[u["head"]] @ w.W_O(u["layer"])[u["head"]])
            else:
                key = (u["layer"], u["head"])
                if key not in svd_cache:
                    ov = w.W_V(u["layer"])[u["head"]] @ w.W_O(u["layer"])[u["head"]]  # [d_model, d_model]
                    _, S, Vh = torch.linalg.svd(ov.double())
                    svd_cache[key] = (S[:, None] * Vh).to(ov.dtype)
                out.append(svd_cache[key][u["direction"]])
        return torch.stack(out)

    def execute(self, prepared: Prepared[ParameterLensState], *, quiet: bool = False) -> Result:
        model, units = prepared.model, prepared.state.units
        with torch.no_grad():
            V = self.vectors(model, units)
            space = model.weights.W_U if self.space == "unembed" else model.weights.W_E.T
            scores = V @ space  # [U, d_vocab]
        vocab = model.vocab_strings()
        k = min(self.top_k, scores.shape[-1])
        top_v, top_i = scores.topk(k, dim=-1)
        bot_v, bot_i = (-scores).topk(k, dim=-1)
        rows = []
        for j, u in enumerate(units):
            rec: dict[str, Any] = {"target": self.target, "space": self.space}
            rec.update({key: (vocab[val] if key == "token" else val) for key, val in u.items()})
            rec["norm"] = float(V[j].norm())
            for t in range(k):
                rec[f"top{t + 1}_token"] = vocab[int(top_i[j, t])]
                rec[f"top{t + 1}_score"] = float(top_v[j, t])
            for t in range(k):
                rec[f"bottom{t + 1}_token"] = vocab[int(bot_i[j, t])]
                rec[f"bottom{t + 1}_score"] = float(-bot_v[j, t])
            rows.append(rec)
        keys = tuple(units[0]) if units else ()  # the columns that name a unit (layer, neuron; dictionary, feature)
        return Result(self.name, pd.DataFrame(rows), title=f"parameter lens: {self.target} through {self.space}",
                      extra={"scores": scores}, takeaway=partial(parameter_takeaway, name_of=self.unit_name,
                                                                  keys=keys, reading=self.reading()))

    def reading(self) -> str:
        """How the vectors are read, as the takeaway says it."""
        return SPACES[self.space]

    def unit_name(self, row: Any) -> str:
        """A table row's unit in the naming scheme (docs/pages.md): m1.n3, a2.h0 on ' Mary', a2.h0 OV direction 1."""
        if self.target in ("neuron_out", "neuron_in"):
            return naming.neuron(int(row["layer"]), int(row["neuron"]))
        if self.target == "embedding":
            return f"the embedding of {row['token']!r}"
        head = naming.head(int(row["layer"]), int(row["head"]))
        return f"{head} on {row['token']!r}" if "token" in row and isinstance(row["token"], str) else \
            f"{head} OV direction {int(row['direction'])}"
