"""Direct logit attribution: the final residual stream split into its components, each projected
onto the answer direction through the final norm with its scale frozen.

At each prompt's last position (where the answer is predicted), with x = resid_post of the last
layer = sum of the components c (see `decompose`):

    logit direction  u = mean_{a in answers} W_U[:, a] - mean_{w in wrong} W_U[:, w]   (logit_diff)
                     u = mean_{a in answers} W_U[:, a]                                 (logit)
    contribution     DLA(c) = (centre(c) / s * w_norm) . u
    constant         K = b_norm . u + (mean b_U[answers] - mean b_U[wrong])           (logit: no wrong)

where s is the final norm's ACTUAL scale on x (read from the model: ln_final's hook_scale, i.e.
sqrt(mean(centre(x)^2) + eps)), frozen, so the norm is linear in x; centre() subtracts the mean over
d_model for LayerNorm and is the identity for RMSNorm; w_norm, b_norm are the final norm's weight and
bias (absent once folded into W_U, b_U). This is TransformerLens's `apply_ln_to_stack` with the
final scale (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits": direct path;
Wang et al. 2022 for the logit difference of IOI). Signs: positive rows push towards the answers
(and away from the wrong answers). The metric matches `entoscope.metrics.logit_diff` / `logit`
(means over each answer set).

Identity, checked on every call: for every prompt b,
    |sum_c DLA_b(c) + K_b - value_b| <= tolerance * max(1, |value_b|) + eps / 2 * (mean_a |l_a| + mean_w |l_w|)
where value_b is the model's own logit (difference) at that position, made of logits l rounded to the model's
dtype (eps its machine epsilon: the second term is their rounding, `value_rounding`). Default tolerance: 1e-4
for float32/float64 models, 2e-2 for float16/bfloat16 ones. When it fails the run refuses
(CheckFailedError, code "dla_identity_failed") and returns no numbers. Contributions are computed
in float64 from the model's activations.

Over the dataset (`summarise_dla`, from the per-prompt table alone): each row's `mean` contribution
with its bootstrap interval over prompts (`mean_ci_low`, `mean_ci_high`, `mean_se`, `ci_level`), a
two-sided p-value against no direct effect (`mean_p`), its Benjamini-Hochberg q-value over the
table's rows (`mean_q`) and `significant` (q <= stats.fdr). `std` and `mean_abs` are descriptive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..errors import CheckFailedError, ConfigError, DataError
from ..executors.columns import PromptColumns
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import at_positions
from ..metrics import logit as logit_metric
from ..metrics import logit_diff as logit_diff_metric
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED, Footprint
from ..models.guards import require_linear_logits
from ..models.names import ActName
from ..models.weights import Norm
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.figures import interval_note, metric_unit, noted
from ..results.lazy import LazyDict, LazyTable
from ..results.result import Result
from ..stats import Stats, ci_text, interval_columns, streamed_mean, summarise
from ..stats.columns import hover_value, interval_bars, level_text
from ..stats.footprint import summary_bytes
from ..stats.moments import column_moments
from .decompose import Component, component_dots, components, decomposition_reads
from .scores_takeaway import TOP_SHARE_FILE, dla_takeaway, top_share

FULL_PRECISION_TOLERANCE = 1e-4
HALF_PRECISION_TOLERANCE = 2e-2


def answer_direction(model: ModelAdapter, answers: Tensor, wrong: Tensor | None) -> tuple[Tensor, Tensor]:
    """(u [B, d_model], b_U part [B]): mean W_U column (and b_U) of the answers, minus the wrong ones'."""
    w = model.weights
    W_U, b_U = w.W_U, w.b_U

    def mean_over(ids: Tensor) -> tuple[Tensor, Tensor]:
        ids = ids.to(W_U.device)
        mask = (ids >= 0).to(torch.float64)
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        safe = ids.clamp(min=0)
        # the answers' columns only, then float64 (a float64 copy of all of W_U was 300 MB on GPT-2 small)
        cols = W_U.T[safe].to(torch.float64) * mask[..., None]  # [B, A, d_model]
        return cols.sum(1) / n, (b_U[safe].to(torch.float64) * mask).sum(-1) / n[:, 0]

    u, bias = mean_over(answers)
    if wrong is not None:
        u_w, bias_w = mean_over(wrong)
        u, bias = u - u_w, bias - bias_w
    return u, bias


def frozen_norm_direction(norm: Norm, u: Tensor, scale: Tensor) -> Tensor:
    """d with c . d = linear_part(c, scale) . u for every c: the adjoint of c -> centre(c) / s * w
    (the centring matrix is symmetric), i.e. d = centre(w * u) / s. u [B, d], scale [B, 1]."""
    wu = u * norm.weight.to(u.dtype) if norm.weight is not None else u
    return norm.center(wu) / scale.to(u.dtype)


def default_tolerance(dtype: torch.dtype) -> float:
    return HALF_PRECISION_TOLERANCE if dtype in (torch.float16, torch.bfloat16) else FULL_PRECISION_TOLERANCE


@dataclass(frozen=True)
class DLAState:
    """What DLA's prepare resolved."""

    batches: list[Batch]
    components: list[Component]  # the table's rows, in order
    split: list[int]  # layers whose MLPs are split into neurons
    n: int  # prompts
    tol: float  # relative tolerance of the identity check


@register_operation
class DirectLogitAttribution(Sharded, Operation):
    """Direct logit attribution: every component's direct effect on the answer logit (difference).

    metric:        "logit_diff" (answers minus wrong answers, means over each set) or "logit".
    neurons:       split the MLPs of `neuron_layers` into one row per neuron plus b_out.
    neuron_layers: which layers' MLPs to split (default: all, when neurons is true).
    tolerance:     relative tolerance of the identity check (default 1e-4; 2e-2 for half precision).
    top_k:         components shown in the bar chart.
    """

    name = "dla"
    tests_cells = True  # p, q and significant per row (the plan's screen: operation.screen_plan)
    metric: Literal["logit_diff", "logit"] = Field(default="logit_diff", description="logit_diff (answers minus "
                                                   "wrong answers, a mean over each set) or logit")
    neurons: bool = Field(default=False, description="split the MLPs of neuron_layers into one row per neuron plus "
                          "b_out")
    neuron_layers: list[int] | None = Field(default=None, description="layers whose MLPs are split (default: all, "
                                            "when neurons is true)")
    tolerance: float | None = Field(default=None, gt=0, description="relative tolerance of the identity check "
                                    "(default 1e-4; 2e-2 in half precision)")
    top_k: int = Field(default=20, ge=1, description="components shown in the bar chart")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[DLAState]:
        assert data is not None
        s = model.structure
        require_linear_logits(model, "DLA")  # Gemma 2's final tanh cap: no sum of parts is the logit
        if self.neuron_layers is not None and not self.neurons:
            raise ConfigError("neuron_layers is given but neurons is false", code="config_invalid",
                              remedy="set neurons: true, or drop neuron_layers")
        split: list[int] = []
        if self.neurons:
            chosen = list(range(s.n_layers)) if self.neuron_layers is None else self.neuron_layers
            for L in chosen:
                if not -s.n_layers <= L < s.n_layers:
                    raise ConfigError(f"neuron layer {L} is out of range: this model has {s.n_layers} layers",
                                      code="site_out_of_range", remedy=f"use 0..{s.n_layers - 1}")
            split = sorted({L % s.n_layers for L in chosen})
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, answers=True,
                           answer_scoring=self.answer_scoring)
        if self.metric == "logit_diff":
            lacking = [i for i, w in enumerate(td.wrong_answers or []) if not w]
            if lacking:
                raise DataError(f"{len(lacking)} examples have no wrong answer (first: {lacking[:5]}), so the "
                                "logit difference is undefined", code="metric_needs_answers",
                                remedy="give each example wrong_answers, or use metric: logit")
        comps = components(s, split)
        T = max(td.lengths)
        peak = dla_footprint(model, decomposition_reads(s, split) + [ActName("final_scale")], len(comps), len(td), T,
                             bool(split), self.stats)
        bs = self.choose_batch_size(0, len(td), peak_of=peak)
        batches = make_batches(td, bs, pad_id(model))
        tol = self.tolerance if self.tolerance is not None else default_tolerance(model.unembedding_dtype)
        notes = [f"identity checked per prompt: |sum of rows + constant - model's {self.metric}| <= "
                 f"{tol:g} * max(1, |{self.metric}|)",
                 "final norm scale frozen at its value on the final residual stream (apply_ln_to_stack)"]
        plan = Plan(self.name, rows=len(comps), forward_passes=len(td), backward_passes=0,
                    batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=peak(bs), notes=notes,
                    files=["table.csv", "table.parquet", "per_prompt.csv", "per_prompt.parquet", "index.html",
                           "identity.csv", "manifest.json"])
        return Prepared(model, data, plan, DLAState(batches, comps, split, len(td), tol))

    # sharded (docs/scale.md): a shard returns its prompts' contributions and the identity's terms
    def execute_shard(self, prepared: Prepared[DLAState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        reads = decomposition_reads(model.structure, st.split) + [ActName("final_scale")]
        mine = [st.batches[i] for i in batches]
        parts: dict[str, list[Tensor]] = {"contrib": [], "value": [], "constant": [], "sum": [], "rounding": []}
        for batch in progress(mine, total=len(mine), desc="dla", quiet=quiet):
            out = model.run(batch.tokens, reads, logits_at=batch.last)  # the answer position's logits only
            with torch.no_grad():
                rows, const, value = self._attribute(model, out.acts, out.logits, batch, st.split)
            parts["contrib"].append(rows.T.cpu())
            parts["value"].append(value.cpu())
            parts["constant"].append(const.cpu())
            parts["sum"].append(rows.sum(0).cpu())
            wrong = batch.wrong_answers if self.metric == "logit_diff" else None
            parts["rounding"].append(value_rounding(out.logits, batch.last, batch.answers, wrong).cpu())
        return PerPrompt([i for b in mine for i in b.index],
                         {k: torch.cat(v).to(torch.float64).numpy() for k, v in parts.items()})

    def summarise(self, prepared: Prepared[DLAState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        st, columns = prepared.state, merged["main"]
        comps = st.components
        ident = {k: torch.from_numpy(columns[k]) for k in ("value", "constant", "sum", "rounding") if k in columns}
        identity = self._check(ident, st.tol)
        frame = _component_frame(comps)
        read = _contributions(columns)
        table = dla_summary(columns.n, frame, read, self.stats, self.seed)
        per_prompt = LazyTable(columns.n, lambda lo, hi: _per_prompt(frame, read(lo, hi), lo),
                               rows_per_prompt=len(comps))
        extra = LazyDict({"components": comps, "identity": identity, "metric": self.metric,
                          "contribution_blocks": read},
                         {"contributions": lambda: torch.from_numpy(columns["contrib"]).T})  # [components, prompts]
        return DLAResult(self.name, table, per_prompt=per_prompt, figures=self._figures,
                         title=f"direct logit attribution: each component's direct contribution to the {self.metric}",
                         extra=extra, takeaway=dla_takeaway)

    def _attribute(self, model: ModelAdapter, acts: dict[ActName, Tensor], logits: Tensor, batch: Any,
                   split: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(rows [C, B], constant [B], the model's own value [B]) for one batch, in float64; logits [B, V] at each
        prompt's last position (the run keeps the last position's only)."""
        wrong = batch.wrong_answers if self.metric == "logit_diff" else None
        return attribute(model, acts, logits, batch.last, batch.answers, wrong, split)

    def _check(self, ident: dict[str, Tensor], tol: float) -> pd.DataFrame:
        return check_identity(ident, tol, self.metric)

    def _figures(self, result: Result) -> list[tuple[str, Any]]:
        return dla_figures(result, self.top_k)


def attribute(model: ModelAdapter, acts: dict[ActName, Tensor], logits: Tensor, last: Tensor, answers: Tensor,
              wrong: Tensor | None, split: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(rows [C, B], constant [B], the model's own value [B]) in float64: each component's direct contribution
    to the logit difference (`wrong` given) or the answers' logit (`wrong` None) at positions `last` [B], read
    from a run's `acts` (`decomposition_reads` + final_scale) and its `logits`: [B, T, V], or [B, V] already at
    `last` (the module docstring)."""
    u, b_U_part = answer_direction(model, answers, wrong)
    norm = model.weights.final_norm
    scale = acts[ActName("final_scale")][torch.arange(len(last)), last.to(logits.device)]  # [B, 1]
    direction = frozen_norm_direction(norm, u, scale.to(torch.float64))
    rows = component_dots(model, acts, last, direction, split or [])
    constant = b_U_part if norm.bias is None else u @ norm.bias.to(torch.float64) + b_U_part
    final = at_positions(logits, last) if logits.dim() == 3 else logits  # [B, V]
    # the metric reads the answers' (and wrong answers') columns only: those are taken before the float64 copy
    # (a [B, vocabulary] float64 copy is 16 MiB for 8 prompts of Gemma 3)
    answers = answers.to(final.device)
    ids = answers if wrong is None else torch.cat([answers, wrong.to(final.device)], -1)
    picked = final.gather(-1, ids.clamp(min=0)).to(torch.float64)
    at = torch.arange(ids.shape[-1], device=final.device).expand_as(ids)
    at = torch.where(ids >= 0, at, -1)  # an answer list's padding (-1) stays padding
    k = answers.shape[-1]
    if wrong is not None:
        value = logit_diff_metric(picked, at[:, :k], at[:, k:])
    else:
        value = logit_metric(picked, at, torch.full_like(at, -1))
    return rows, constant, value


def value_rounding(logits: Tensor, last: Tensor, answers: Tensor, wrong: Tensor | None) -> Tensor:
    """[B] float64: how far the model's own value can be from the exact one because its logits are rounded to
    the model's dtype: half a unit in the last place of each logit the metric reads, at most eps / 2 |logit|,
    summed as the metric sums them: eps / 2 (mean_a |l_a| + mean_w |l_w|). In bfloat16 (eps 2^-7) a logit of 20
    is off by up to 0.08, more than 2e-2 of a logit difference of 3; in float32 it is 1e-6."""
    eps = torch.finfo(logits.dtype).eps if logits.dtype.is_floating_point else 0.0
    final = (at_positions(logits, last) if logits.dim() == 3 else logits).to(torch.float64).abs()
    answers = answers.to(final.device)
    size = logit_metric(final, answers, torch.full_like(answers, -1))
    if wrong is not None:
        wrong = wrong.to(final.device)
        size = size + logit_metric(final, wrong, torch.full_like(wrong, -1))
    return eps / 2 * size


def check_identity(ident: dict[str, Tensor], tol: float, metric: str) -> pd.DataFrame:
    """The identity per prompt (value, constant, sum_of_rows, error, allowed), or a refusal where the rows
    and the constant do not add up to the model's own `metric` (`ident`: value, constant, sum, [B] each; and
    `rounding`, `value_rounding`, which `allowed` adds to tol * max(1, |value|))."""
    error = (ident["sum"] + ident["constant"] - ident["value"]).abs()
    allowed = tol * ident["value"].abs().clamp(min=1.0) + ident.get("rounding", torch.zeros_like(error))
    frame = pd.DataFrame({"example": np.arange(len(error)), "value": ident["value"].numpy(),
                          "constant": ident["constant"].numpy(), "sum_of_rows": ident["sum"].numpy(),
                          "error": error.numpy(), "allowed": allowed.numpy()})
    bad = ~(error <= allowed)  # NaN fails the check (NaN > tol would be False)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0]) if bool(error.isnan().any()) else int((error / allowed).argmax())
        raise CheckFailedError(
            f"direct logit attribution does not add up on {int(bad.sum())} of {len(error)} prompts: on "
            f"example {i} the rows sum to {float(ident['sum'][i]):.6g} + constant "
            f"{float(ident['constant'][i]):.6g}, but the model's {metric} is {float(ident['value'][i]):.6g} "
            f"(error {float(error[i]):.3g} > allowed {float(allowed[i]):.3g})",
            code="dla_identity_failed",
            remedy="the model's residual stream is not the sum entoscope decomposes (an unsupported block "
            "layout, or hooks changing activations); for a model run in reduced precision pass a larger "
            "tolerance")
    return frame


def dla_footprint(model: ModelAdapter, reads: list[ActName], C: int, n: int, T: int, split: bool,
                  stats: Stats) -> Callable[[int], int]:
    """peak(B) above the loaded model (memory.py): per prompt of a batch the activations read and a forward with
    the last position's logits; every prompt's C contributions (float64); while a layer is dotted
    (decompose.component_dots, after the forward: the reads kept, the forward's own transient gone), its W_O in
    float64 and its heads' vectors (the einsum's, the post-norm's and the product's [H, B, d_model]), or with
    neurons split its W_out in float64; when the table is made, the statistics' chunks."""
    fp, s = Footprint(model), model.structure
    read, forward = fp.act(reads, 1, T), fp.forward(1, T, logit_rows=1)
    values = n * (C + 3) * 8 * 2
    w_o = 8 * s.n_heads * s.d_head * s.d_model
    w_out = 8 * s.d_mlp * s.d_model if split else 0

    def peak(B: int) -> int:
        dots = max(w_o + 3 * 8 * s.n_heads * B * s.d_model, w_out)
        return FIXED + values + max(B * read + max(B * forward, dots), summary_bytes(n, C, stats))
    return peak


class DLAResult(Result):
    """A DLA result that also saves the identity check (identity.csv)."""

    def save_extra(self, folder: Path, files: list[str]) -> None:
        self.extra["identity"].to_csv(folder / "identity.csv", index=False)
        files.append("identity.csv")
        share = top_share(self)
        if share is not None:  # the share the takeaway quotes
            (folder / TOP_SHARE_FILE).write_text(json.dumps(share, indent=2), encoding="utf-8")
            files.append(TOP_SHARE_FILE)


def _component_frame(comps: list[Component]) -> pd.DataFrame:
    return pd.DataFrame({
        "component": [c.label for c in comps], "kind": [c.kind for c in comps],
        "layer": pd.array([c.layer for c in comps], dtype="Int64"),
        "head": pd.array([c.head for c in comps], dtype="Int64"),
        "neuron": pd.array([c.neuron for c in comps], dtype="Int64"),
    })


def _contributions(columns: PromptColumns) -> Any:
    """read(lo, hi) -> the contributions [rows, components] of prompts lo..hi-1."""
    return lambda lo, hi: columns.read(lo, hi, ["contrib"])["contrib"]


def _per_prompt(components: pd.DataFrame, contrib: np.ndarray, lo: int) -> pd.DataFrame:
    """The per-prompt rows of prompts lo.. (one per prompt and component) from their contributions [rows, C]."""
    N, C = contrib.shape
    frame = components.iloc[np.tile(np.arange(C), N)].reset_index(drop=True)
    frame.insert(0, "example", np.repeat(np.arange(lo, lo + N), C))
    frame["contribution"] = np.asarray(contrib, dtype=np.float64).reshape(-1)
    return frame


COMPONENT_COLUMNS = ["component", "kind", "layer", "head", "neuron"]


def summarise_dla(per_prompt: pd.DataFrame, stats: Stats, seed: int) -> pd.DataFrame:
    """One row per component from the per-prompt table (example, component, ..., contribution): what
    `dla_summary` computes from the arrays."""
    frame = per_prompt.drop_duplicates("component")[COMPONENT_COLUMNS].reset_index(drop=True)
    grid = per_prompt.pivot(index="example", columns="component", values="contribution")
    values = grid.reindex(columns=frame["component"]).to_numpy(dtype=np.float64)  # [n_prompts, components]
    return dla_summary(len(values), frame, lambda lo, hi: values[lo:hi], stats, seed)


def dla_summary(n: int, components: pd.DataFrame, read: Any, stats: Stats, seed: int) -> pd.DataFrame:
    """One row per component from the contributions read in blocks (read(lo, hi) -> [rows, components]):
    mean, std (ddof 0) and mean |contribution| over prompts, with intervals, p/q-values, significance."""
    frame = components.copy()
    C = len(frame)
    mean = summarise(streamed_mean(n, C, read), stats, seed)
    frame["mean"] = mean.value
    for key, col in interval_columns(mean, "mean", stats, test=True).items():
        frame[key] = col
    m = column_moments(n, 2 * C, lambda lo, hi: np.concatenate([(v := np.asarray(read(lo, hi), np.float64)),
                                                                 np.abs(v)], axis=1))
    frame["std"] = m.std[:C]
    frame["mean_abs"] = m.mean[C:]  # descriptive (no interval: the test is on `mean`)
    frame["n_prompts"] = n
    frame["ci_level"] = stats.ci_level
    return frame


def _hover(t: pd.DataFrame) -> list[str]:
    out = []
    for r in t.to_dict("records"):
        text = f"{r['component']}<br>{hover_value(r, 'mean')}"
        if ci_text(r, "mean") and "mean_q" in r:
            text += f"<br>q = {r['mean_q']:.2g}" + (" (significant)" if r["significant"] else "")
        out.append(text + f"<br>n = {int(r['n_prompts'])}")
    return out


def dla_figures(result: Result, top_k: int = 20) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    unit = metric_unit(result.extra.get("metric", ""))
    top = t.reindex(t["mean"].abs().sort_values(ascending=False).index).head(top_k).iloc[::-1]
    bars = interval_bars(top, "mean", "component", axis="x")
    if not bars:  # stats.n_boot 0: no interval, the spread over prompts instead (said so)
        bars = {"error_x": {"type": "data", "array": top["std"]}}
    what = interval_note(level_text(t)) if "customdata" in bars else \
        "error bars: std over prompts (no interval: stats.n_boot 0)"
    bar = go.Figure(go.Bar(x=top["mean"], y=top["component"], orientation="h", text=_hover(top),
                           hovertemplate="%{text}<extra></extra>", textposition="none",
                           marker_color=np.where(top["mean"] >= 0, "#2b6cb0", "#c53030"), **bars))
    bar.update_layout(xaxis_title=noted(f"mean direct contribution ({unit})", what), height=160 + 22 * len(top))
    figs = [(f"top {len(top)} components by |mean contribution|", bar)]
    heads = t[t["kind"] == "head"]
    if len(heads):
        grid = heads.pivot(index="layer", columns="head", values="mean")
        hover = heads.assign(_hover=_hover(heads)).pivot(index="layer", columns="head", values="_hover")
        mlps = t[t["kind"].isin(["mlp", "neuron", "mlp_bias"])]
        mlp = mlps.groupby("layer")["mean"].sum()
        whole = t[t["kind"] == "mlp"].set_index("layer")  # an unsplit MLP is one row: its own hover
        mlp_hover = [_hover(whole.loc[[L]].reset_index())[0] if L in whole.index else
                     f"{naming.mlp(L)}: sum of its rows (neurons and b_out) {mlp.get(L, np.nan):.3g}"
                     for L in grid.index]
        z = np.column_stack([grid.values, mlp.reindex(grid.index).to_numpy(dtype=float)])
        text = np.column_stack([hover.reindex(index=grid.index, columns=grid.columns).values, mlp_hover])
        x = [f"h{h}" for h in grid.columns] + ["mlp"]
        lim = float(np.nanmax(np.abs(z))) or 1.0
        heat = go.Figure(go.Heatmap(z=z, x=x, y=[int(v) for v in grid.index], zmid=0, zmin=-lim, zmax=lim,
                                    colorscale="RdBu", texttemplate="%{z:.2f}", customdata=text,
                                    hovertemplate="%{customdata}<extra></extra>",
                                    colorbar={"title": f"mean direct<br>contribution ({unit})"}))
        heat.update_layout(xaxis_title="head (and the layer's MLP)", yaxis_title="layer", height=140 + 40 * len(grid))
        figs.append((f"mean direct contribution by layer and head (hover: the {level_text(t)} interval over prompts "
                     "and the BH q-value)", heat))
    return figs
