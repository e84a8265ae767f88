"""Direct logit attribution per dictionary feature: DLA (circuits/dla.py) with the writes of dictionary sites
split into their features, an error row and the decoder bias.

At each prompt's last position, with d the answer direction through the frozen final norm (DLA's
`frozen_norm_direction`) and, for each dictionary D at a site x_out it writes:

    x_out = sum_i f_i W_dec[i] + b_dec + error          f = D.encode(x_in), error = x_out - D.decode(f)
    feature row   f_i (W_dec[i] . d)
    error row     error . d
    constant      DLA's constant (final-norm bias, b_U) + sum over dictionaries of b_dec . d

The dictionaries replace the components their site sums (circuits/decompose.py): a transcoder or an SAE
on mlp_out.L replaces m{L}; one on attn_out.L replaces layer L's heads and a{L}.b_O; an SAE on
resid_post.L replaces everything up to layer L (embeddings, every head and MLP of layers 0..L), so only
one resid_post layer at a time. The other components stay DLA rows. The identity

    sum of feature rows + error rows + other component rows + constant = the model's logit (difference)

is checked on every prompt exactly as DLA checks its own (`DirectLogitAttribution._check`; a failure
refuses with dla_identity_failed); identity.csv (extra["identity"]) has, per prompt, value, constant,
decoder_bias (the b_dec part of the constant), sum_of_rows, error and allowed. Wide dictionaries: the table keeps every feature active at the last
position of some prompt (an inactive feature's row is exactly zero); per prompt, the `top_k_features`
rows of largest |contribution| per dictionary and one "other features" row holding the rest, so each
prompt's rows still add up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from ..circuits.decompose import Component, components, decomposition_reads
from ..circuits.dla import (
    DirectLogitAttribution,
    DLAResult,
    DLAState,
    answer_direction,
    dla_summary,
    frozen_norm_direction,
)
from ..data.examples import Dataset
from ..errors import ConfigError
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..operation import Prepared, progress, register_operation
from ..results.result import Result
from ..sites import Selection, Sites
from ..stats import Stats, interval_columns, share_interval, streamed_mean, summarise
from ..models.dictionaries.catalog import get_dictionary
from .dla_takeaway import feature_dla_takeaway

WRITTEN = ("resid_post", "mlp_out", "attn_out")


def replaced(component: Component, activation: str, layer: int) -> bool:
    """Whether a dictionary on `activation`.`layer` replaces this component of the final residual."""
    if activation == "mlp_out":
        return component.kind == "mlp" and component.layer == layer
    if activation == "attn_out":
        return component.kind in ("head", "attn_bias") and component.layer == layer
    return component.layer is None or component.layer <= layer  # resid_post: everything up to layer


@dataclass(frozen=True)
class FeatureDLAState(DLAState):
    """DLA's state, with the dictionary sites and the components they leave as DLA rows."""

    bases: list[tuple[int, str]]  # (layer, dictionary key) of each dictionary site
    kept: list[Component]  # the components no dictionary replaces


@register_operation
class FeatureDLA(DirectLogitAttribution):
    """Direct logit attribution with dictionary sites split into features (docs/features.md).

    dictionary:      a dictionary or a release (demo: the bundled ones), as in Sites(dictionary=...).
    activation:      what the dictionaries write: mlp_out (transcoders), attn_out, or resid_post (one layer).
    layers:          which layers' dictionaries ("all": every layer the release covers).
    top_k_features:  per prompt and dictionary, the features kept as their own rows of per_prompt.
    (metric, tolerance, top_k, answer_scoring as for dla; neurons is not available here.)
    """

    name = "feature_dla"
    dictionary: str = Field(default="demo", description="a dictionary or a release (demo: the bundled ones), as in "
                            "Sites(dictionary=...)")
    activation: Literal["resid_post", "mlp_out", "attn_out"] = Field(default="mlp_out", description="what the "
        "dictionaries write: mlp_out (transcoders), attn_out, or resid_post (one layer)")
    layers: Selection = Field(default="all", description="which layers' dictionaries (all: every layer the release "
                              "covers)")
    top_k_features: int = Field(default=10, ge=1, description="per prompt and dictionary, the features kept as their "
                                "own rows of per_prompt")

    def not_sharded_reason(self) -> str:  # its own execute over every batch (not split into shards yet)
        return "it does not split into shards of prompts"

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[FeatureDLAState]:
        if self.neurons:
            raise ConfigError("feature_dla splits dictionary sites into features, not MLPs into neurons",
                              code="config_invalid", remedy="drop neurons (use dla for neuron rows)")
        siteset = Sites(activation=self.activation, dictionary=self.dictionary, layers=self.layers,
                        over=["layer"]).resolve(model)
        bases = list(siteset.bases)
        if self.activation == "resid_post" and len(bases) != 1:
            raise ConfigError(f"resid_post dictionaries of {len(bases)} layers: each replaces everything up to its "
                              "layer, so one decomposition holds one of them", code="feature_dla_layers",
                              remedy="give one layer, e.g. layers: 2")
        prepared: Prepared[Any] = super().prepare(model, data)
        dla = prepared.state
        comps = [c for c in dla.components if not any(replaced(c, self.activation, L) for L, _ in bases)]
        prepared.state = FeatureDLAState(**{f.name: getattr(dla, f.name) for f in fields(dla)}, bases=bases,
                                         kept=comps)
        prepared.plan.operation = self.name
        # a table row per kept component, per dictionary its error and each feature active in some prompt
        prepared.plan.rows = len(comps) + sum(1 + get_dictionary(key).d_sae for _, key in bases)
        prepared.plan.notes.append("rows: at most (a feature gets a row where it is active in some prompt)")
        prepared.plan.notes.append("dictionary sites: " + ", ".join(f"{self.activation}.{L} <- {k}" for L, k in bases))
        return prepared

    def execute(self, prepared: Prepared[FeatureDLAState], *, quiet: bool = False) -> Result:
        model, st = prepared.model, prepared.state
        bases = st.bases
        all_comps: list[Component] = components(model.structure)
        keep = torch.tensor([c in st.kept for c in all_comps])
        reads = decomposition_reads(model.structure) + [ActName("final_scale")]
        reads += [a for L, key in bases for a in (ActName("features", L, key), ActName(self.activation, L))]
        n = st.n
        k = min(self.top_k_features, *(get_dictionary(key).d_sae for _, key in bases))
        comp_rows = torch.zeros(int(keep.sum()), n, dtype=torch.float64)
        err_rows = torch.zeros(len(bases), n, dtype=torch.float64)
        rest_rows = torch.zeros(len(bases), n, dtype=torch.float64)
        top_val = torch.zeros(len(bases), n, k, dtype=torch.float64)
        top_idx = torch.zeros(len(bases), n, k, dtype=torch.long)
        active: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in bases]  # (prompts, features, rows)
        ident = {x: torch.zeros(n, dtype=torch.float64) for x in ("value", "constant", "sum", "decoder_bias")}
        for batch in progress(st.batches, total=len(st.batches), desc="feature dla", quiet=quiet):
            out = model.run(batch.tokens, reads, logits_at=batch.last)  # the answer position's logits only
            idx = torch.tensor(batch.index)
            with torch.no_grad():
                rows, constant, value = self._attribute(model, out.acts, out.logits, batch, [])
                direction = self._direction(model, out.acts, batch)  # [B, d_model] float64
                total = rows[keep].sum(0)
                comp_rows[:, idx] = rows[keep].cpu()
                for j, (L, key) in enumerate(bases):
                    f_rows, err, bias = _feature_rows(get_dictionary(key), out.acts[ActName("features", L, key)],
                                                      out.acts[ActName(self.activation, L)], batch.last, direction)
                    total = total + f_rows.sum(1) + err
                    constant = constant + bias
                    ident["decoder_bias"][idx] += bias.cpu()
                    err_rows[j, idx] = err.cpu()
                    top = f_rows.abs().topk(k, dim=1).indices
                    top_idx[j, idx] = top.cpu()
                    top_val[j, idx] = f_rows.gather(1, top).cpu()
                    rest_rows[j, idx] = (f_rows.sum(1) - f_rows.gather(1, top).sum(1)).cpu()
                    fr = f_rows.cpu()
                    at = fr.nonzero()  # an inactive feature's row is exactly zero: kept sparse
                    active[j].append((idx[at[:, 0]], at[:, 1], fr[at[:, 0], at[:, 1]]))
            ident["value"][idx], ident["constant"][idx], ident["sum"][idx] = value.cpu(), constant.cpu(), total.cpu()
        identity = self._check(ident, st.tol)
        identity.insert(int(identity.columns.get_loc("constant")) + 1, "decoder_bias", ident["decoder_bias"].numpy())
        kept = st.kept
        table = _table(kept, comp_rows, bases, err_rows, active, n, self.stats, self.seed)
        per_prompt = _per_prompt(kept, comp_rows, bases, err_rows, rest_rows, top_idx, top_val)
        return DLAResult(self.name, table, per_prompt=per_prompt, figures=self._figures,
                         title=f"direct logit attribution per feature ({self.metric}, {self.activation} dictionaries)",
                         extra={"identity": identity, "bases": bases, "components": kept},
                         takeaway=partial(feature_dla_takeaway, metric=self.metric))

    def _direction(self, model: ModelAdapter, acts: dict[ActName, Tensor], batch: Any) -> Tensor:
        """The answer direction through the frozen final norm, as DLA's `_attribute` builds it."""
        wrong = batch.wrong_answers if self.metric == "logit_diff" else None
        u, _ = answer_direction(model, batch.answers, wrong)
        scale = acts[ActName("final_scale")][torch.arange(len(batch)), batch.last.to(u.device)]
        return frozen_norm_direction(model.weights.final_norm, u, scale.to(torch.float64))


def _feature_rows(d: Any, features: Tensor, x_out: Tensor, last: Tensor, direction: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(feature rows [B, d_sae], error row [B], decoder-bias part [B]) at each prompt's last position."""
    rows = torch.arange(features.shape[0], device=features.device)
    f = features[rows, last.to(features.device)].double()
    x = x_out[rows, last.to(x_out.device)].double()
    W_dec, b_dec = d.W_dec.to(f.device, torch.float64), d.b_dec.to(f.device, torch.float64)
    error = x - (f @ W_dec + b_dec)
    dirn = direction.to(f.device)
    return f * (dirn @ W_dec.T), (error * dirn).sum(-1), dirn @ b_dec


def _feature_label(key: str, i: int) -> str:
    return f"{key} f{i}"


def _component_rows(comps: list[Component]) -> list[dict[str, Any]]:
    return [{"component": c.label, "kind": c.kind, "layer": c.layer, "head": c.head, "dictionary": None,
             "feature": None} for c in comps]


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    for col in ("layer", "head", "feature"):
        frame[col] = pd.array(frame[col], dtype="Int64")
    return frame


def _table(comps: list[Component], comp_rows: Tensor, bases: list[tuple[int, str]], err_rows: Tensor,
           active: list[list[tuple[Tensor, Tensor, Tensor]]], n: int, stats: Stats, seed: int) -> pd.DataFrame:
    """One row per kept component, per dictionary its error and each feature active in some prompt: DLA's
    summary (`dla_summary`: mean with its interval and p/q, std, mean |contribution|) of the per-prompt
    contributions, and `active_share`, the share of prompts where the feature is active, with its interval."""
    rows = _component_rows(comps)
    entries: list[tuple[Tensor, Tensor, Tensor]] = []  # (prompt, column, contribution) of active features
    width = len(comps)
    err_cols, feature_cols = [], []
    for j, (L, key) in enumerate(bases):
        rows.append({"component": f"{key} error", "kind": "error", "layer": L, "head": None, "dictionary": key,
                     "feature": None})
        err_cols.append(width)
        width += 1
        prompts, feats, vals = (torch.cat(x) for x in zip(*active[j])) if active[j] else \
            (torch.zeros(0, dtype=torch.long),) * 2 + (torch.zeros(0, dtype=torch.float64),)
        used = torch.unique(feats)  # ascending feature index
        rows += [{"component": _feature_label(key, i), "kind": "feature", "layer": L, "head": None,
                  "dictionary": key, "feature": i} for i in used.tolist()]
        entries.append((prompts, width + torch.searchsorted(used, feats), vals))
        feature_cols.append((width, width + len(used)))
        width += len(used)
    prompts, cols, vals = (torch.cat(x) for x in zip(*entries)) if entries else (torch.zeros(0, dtype=torch.long),) * 3
    order = torch.argsort(prompts, stable=True)
    prompts, cols, vals = prompts[order].numpy(), cols[order].numpy(), vals[order].double().numpy()

    def contributions(lo: int, hi: int) -> np.ndarray:  # [hi - lo, width]
        out = np.zeros((hi - lo, width))
        out[:, : len(comps)] = comp_rows[:, lo:hi].T.numpy()
        for j, c in enumerate(err_cols):
            out[:, c] = err_rows[j, lo:hi].numpy()
        a, b = np.searchsorted(prompts, [lo, hi])
        out[prompts[a:b] - lo, cols[a:b]] = vals[a:b]
        return out
    is_feature = np.zeros(width, dtype=bool)
    for a, b in feature_cols:
        is_feature[a:b] = True

    def activity(lo: int, hi: int) -> np.ndarray:  # a component or error row counts as active in every prompt
        return np.where(is_feature, contributions(lo, hi) != 0, True).astype(np.float64)
    frame = dla_summary(n, _frame(rows), contributions, stats, seed)
    share = summarise(streamed_mean(n, width, activity, skip_nan=False), stats, seed)
    frame.insert(frame.columns.get_loc("n_prompts"), "active_share", share.value)
    columns = interval_columns(share, "active_share", stats)
    # a feature's share of prompts: the Wilson interval (the bootstrap's is degenerate at 0 and n); a component
    # or error row is active by definition, so its [1, 1] stays
    low, high = share_interval(share.value, n, stats.ci_level)
    columns["active_share_ci_low"] = np.where(is_feature, low, columns["active_share_ci_low"])
    columns["active_share_ci_high"] = np.where(is_feature, high, columns["active_share_ci_high"])
    for key, col in columns.items():
        frame.insert(frame.columns.get_loc("n_prompts"), key, col)
    return frame


def _per_prompt(comps: list[Component], comp_rows: Tensor, bases: list[tuple[int, str]], err_rows: Tensor,
                rest_rows: Tensor, top_idx: Tensor, top_val: Tensor) -> pd.DataFrame:
    """Each prompt's rows: the kept components, per dictionary its error, top features and the rest."""
    N = comp_rows.shape[1]
    parts = []
    for e in range(N):
        rows = _component_rows(comps)
        vals = comp_rows[:, e].tolist()
        for j, (L, key) in enumerate(bases):
            rows.append({"component": f"{key} error", "kind": "error", "layer": L, "head": None, "dictionary": key,
                         "feature": None})
            vals.append(float(err_rows[j, e]))
            for i, v in zip(top_idx[j, e].tolist(), top_val[j, e].tolist()):
                rows.append({"component": _feature_label(key, i), "kind": "feature", "layer": L, "head": None,
                             "dictionary": key, "feature": i})
                vals.append(v)
            rows.append({"component": f"{key} other features", "kind": "other_features", "layer": L, "head": None,
                         "dictionary": key, "feature": None})
            vals.append(float(rest_rows[j, e]))
        frame = _frame(rows)
        frame.insert(0, "example", e)
        frame["contribution"] = vals
        parts.append(frame)
    return pd.concat(parts, ignore_index=True)
