"""Choosing circuits from edge scores, and how faithful they are (the MIB circuit track's measures).

Selection (over the edges that exist; ties broken by the graph's edge order):
  top_n      the n edges of largest |score| (largest score with absolute=False)
  threshold  every edge with |score| >= t (score >= t with absolute=False)

Faithfulness of a circuit C (edge patching: kept edges carry clean values, all others corrupt):

    f(C) = (m(C) - m(empty)) / (m(full) - m(empty))

with m the metric averaged over prompts, full = every edge kept (the clean run), empty = no edge
kept (the corrupt run). The curve takes, for each fraction p of the edges (MIB's grid
0.1%, 0.2%, 0.5%, 1%, 2%, 5%, 10%, 20%, 50%, 100% by default), the top n = floor(p * n_edges)
edges. Following MIB (Mueller et al. 2025, "MIB: A Mechanistic Interpretability Benchmark", circuit
localisation track; their `evaluate_area_under_curve`), with the trapezoid rule over the fractions
themselves (linear axis):

    CPR = sum_i (p_{i+1} - p_i) (f_i + f_{i+1}) / 2                     (higher is better)
    CMD = sum_i (p_{i+1} - p_i) (|1 - f_i| + |1 - f_{i+1}|) / 2         (lower is better)

Intervals: m(C), m(full) and m(empty) are means over prompts, so f, CPR and CMD are functions of the
per-prompt metrics; their bootstrap intervals resample prompts (entoscope.stats, docs/statistics.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ..errors import CheckFailedError
from ..stats import RatioStat, Stats, SumsStat, Summary, ratio_stat, summarise
from .edge_patching import EdgePatcher
from .graph import Circuit, ComponentGraph

MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _ranked(graph: ComponentGraph, scores: Tensor, absolute: bool) -> tuple[Tensor, Tensor]:
    """(flat indices of the existing edges, best first; their keys)."""
    key = (scores.abs() if absolute else scores).detach().float().cpu()
    flat = graph.mask.flatten().nonzero()[:, 0]
    values = key.flatten()[flat]
    order = torch.sort(values, descending=True, stable=True).indices
    return flat[order], values[order]


def top_n(graph: ComponentGraph, scores: Tensor, n: int, absolute: bool = True) -> Tensor:
    """[n_senders, n_receivers] bool: the n best edges."""
    flat, _ = _ranked(graph, scores, absolute)
    kept = torch.zeros(graph.n_senders * graph.n_receivers, dtype=torch.bool)
    kept[flat[: max(0, n)]] = True
    return kept.view(graph.n_senders, graph.n_receivers)


def above(graph: ComponentGraph, scores: Tensor, threshold: float, absolute: bool = True) -> Tensor:
    """[n_senders, n_receivers] bool: the edges whose (absolute) score reaches `threshold`."""
    key = (scores.abs() if absolute else scores).detach().float().cpu()
    return graph.mask & (key >= threshold)


def faithfulness(m_circuit: float, m_empty: float, m_full: float) -> float:
    gap = m_full - m_empty
    if gap == 0:
        raise CheckFailedError(
            f"the metric is the same on the clean and the corrupt prompts ({m_full:.4g}): faithfulness "
            "divides by their difference", code="no_clean_corrupt_gap",
            remedy="use a metric and counterfactuals for which the model behaves differently on the two")
    return (m_circuit - m_empty) / gap


def trapezoid(xs: Sequence[float], ys: Sequence[float]) -> float:
    return sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))


def cpr(fractions: Sequence[float], f: Sequence[float]) -> float:
    """Area under the faithfulness curve (MIB's CPR)."""
    return trapezoid(fractions, f)


def cmd(fractions: Sequence[float], f: Sequence[float]) -> float:
    """Area between the faithfulness curve and 1 (MIB's CMD), pointwise |1 - f| then trapezoids."""
    return trapezoid(fractions, [abs(1 - v) for v in f])


def faithfulness_stat(circuit_metrics: Tensor, full: Tensor, empty: Tensor) -> RatioStat:
    """f per circuit as a ratio of means over prompts (circuit_metrics [E] or [E, F]): what is resampled."""
    m = circuit_metrics.double().numpy()
    m = m[:, None] if m.ndim == 1 else m
    f, e = full.double().numpy(), empty.double().numpy()
    return ratio_stat(m - e[:, None], f - e)


def faithfulness_summary(circuit_metrics: Tensor, full: Tensor, empty: Tensor, stats: Stats, seed: int) -> Summary:
    """The faithfulness of one circuit (or one per column) with its bootstrap interval over prompts."""
    return summarise(faithfulness_stat(circuit_metrics, full, empty), stats, seed)


def _areas(fractions: Sequence[float], M: np.ndarray, full: np.ndarray, empty: np.ndarray) -> SumsStat:
    """CPR and CMD under prompt weights: the curve of weighted ratios of means, then the trapezoids.

    A function of weighted sums of [full, empty, M (one column per fraction), 1], so it is summarised
    block by block like a mean."""
    xs = np.asarray(fractions, dtype=float)
    dx = np.diff(xs)
    F = M.shape[1]
    X = np.column_stack([full, empty, M, np.ones(len(full))])

    def g(S: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        tot = S[:, -1:]
        with np.errstate(invalid="ignore", divide="ignore"):
            mf, me = S[:, :1] / tot, S[:, 1:2] / tot
            f = (S[:, 2:2 + F] / tot - me) / (mf - me)  # [K, F]
        cpr_ = (dx * (f[:, 1:] + f[:, :-1]) / 2).sum(1)
        cmd_ = (dx * (np.abs(1 - f[:, 1:]) + np.abs(1 - f[:, :-1])) / 2).sum(1)
        return np.stack([cpr_, cmd_], 1)[:, cols]
    return SumsStat(len(full), 2, X.shape[1], lambda lo, hi: X[lo:hi], g)


def curve_circuits(graph: ComponentGraph, scores: Tensor, fractions: Sequence[float] = MIB_FRACTIONS,
                   absolute: bool = True) -> list[Tensor]:
    """The circuit of each point of the curve: the top floor(p * n_edges) edges, [n_senders, n_receivers] bool."""
    return [top_n(graph, scores, int(p * graph.n_edges), absolute) for p in fractions]


def faithfulness_curve(patcher: EdgePatcher, scores: Tensor, fractions: Sequence[float] = MIB_FRACTIONS,
                       absolute: bool = True, progress_fn=None, stats: Stats | None = None,
                       seed: int = 0) -> tuple[pd.DataFrame, dict[str, float]]:
    """One row per fraction (n edges requested, kept after pruning, metric, faithfulness with its
    interval) and {cpr, cmd (with intervals), m_full, m_empty}. Faithfulness, CPR and CMD are
    functions of the per-prompt metrics (ratio of means), so their intervals resample prompts."""
    items = list(fractions)
    circuits = curve_circuits(patcher.graph, scores, items, absolute)
    chosen = progress_fn(circuits) if progress_fn else circuits
    per_prompt = [patcher.per_prompt(kept) for kept in chosen]
    return curve_table(patcher.graph, items, circuits, per_prompt, patcher.full, patcher.empty, stats, seed)


def curve_table(graph: ComponentGraph, fractions: Sequence[float], circuits: Sequence[Tensor],
                per_prompt: Sequence[Tensor], full: Tensor, empty: Tensor, stats: Stats | None = None,
                seed: int = 0) -> tuple[pd.DataFrame, dict[str, float]]:
    """The curve from each circuit's per-prompt metrics ([E] per fraction) and the full / empty runs' ([E])."""
    stats = stats or Stats()
    items = list(fractions)
    m_full, m_empty = float(full.mean()), float(empty.mean())
    rows = []
    for p, kept, values in zip(items, circuits, per_prompt):
        m = float(values.mean())
        rows.append({"fraction": p, "n_edges": int(p * graph.n_edges),
                     "n_edges_pruned": Circuit(graph, kept=kept).pruned().n_kept,
                     "metric": m, "faithfulness": faithfulness(m, m_empty, m_full)})
    frame = pd.DataFrame(rows)
    summary = {"cpr": float("nan"), "cmd": float("nan"), "m_full": m_full, "m_empty": m_empty}
    if not rows:
        return frame, summary
    M = torch.stack(list(per_prompt), 1)  # [E, F]
    curve = faithfulness_summary(M, full, empty, stats, seed)
    frame["faithfulness_ci_low"], frame["faithfulness_ci_high"] = curve.ci_low, curve.ci_high
    frame["ci_level"] = stats.ci_level
    if len(items) > 1:
        f = list(frame["faithfulness"])
        areas = summarise(_areas(items, M.double().numpy(), full.double().numpy(), empty.double().numpy()),
                          stats, seed)
        summary.update({"cpr": cpr(items, f), "cmd": cmd(items, f),
                        "cpr_ci_low": float(areas.ci_low[0]), "cpr_ci_high": float(areas.ci_high[0]),
                        "cmd_ci_low": float(areas.ci_low[1]), "cmd_ci_high": float(areas.ci_high[1])})
    return frame, summary
