"""Comparisons of a patched metric with the unpatched runs, per prompt and over the dataset.

With m_base the metric of the run being patched, m_source that of the other run of the pair, and
m_patched that of the patched run (for attribution and integrated gradients: m_base + estimate):

    absolute    m_patched
    difference  m_patched - m_base                                  (the indirect effect)
    normalized  (m_patched - m_base) / (m_source - m_base)          0 = no effect, 1 = full recovery
                (denoising: of the clean run's metric; noising: 1 = as damaged as the corrupt run)

A pair is degenerate when |m_source - m_base| <= min_gap or is below `stats.degenerate_share` (10%)
of the dataset's median |gap|: it has no normalised value (NaN in the per-prompt table, `degenerate`
True, counted in `n_degenerate`), since its per-pair ratio explodes.

The table's `value` (the headline) is, for comparison "normalized", the ratio of means (aggregate
"ratio_of_means", the default; Wang et al. 2022): (mean m_patched - mean m_base) / (mean m_source -
mean m_base) over ALL pairs, robust to a pair with a small gap; aggregate "mean_of_ratios" gives the
mean of the per-pair normalised values over the non-degenerate pairs instead (also always in
`normalized_mean`). For "difference" / "absolute" it is the mean over pairs. Every headline carries its
bootstrap interval over prompts (`value_ci_low`, `value_ci_high`, `ci_level`), its standard error,
its p-value against no effect (`value_p`, the inversion of that interval; for "absolute", of the
difference, whose interval is `difference_ci_low` / `difference_ci_high`; `value_p_bound` where p is
the resampling's resolution) and Benjamini-Hochberg q-value over the table's cells (`value_q`,
`significant` at `stats.fdr`), and the leave-one-out
influence of its most influential prompt (`value_influence`, `value_influential_prompt`,
`value_fragile`). docs/statistics.md has the details.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..stats import RatioStat, Stats, SumsStat, Summary, fragile, significance_columns, streamed_mean, summarise
from ..stats.moments import column_moments

COMPARISON_COLUMN = {"absolute": "patched", "difference": "difference", "normalized": "normalized"}


@dataclass
class PairValues:
    """Every comparison of every pair, made block by block from the patched metrics [E, U] (read(lo, hi)).

    base, source [E] and the degenerate flags (which need the dataset's median |gap|) are held whole;
    the [E, U] comparisons are made for the rows asked (`block`)."""

    read_patched: Callable[[int, int], np.ndarray]
    n: int
    n_cells: int
    base: np.ndarray
    source: np.ndarray
    degenerate: np.ndarray
    typical_gap: float

    def block(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """{"patched", "difference", "normalized"} [hi - lo, U] of pairs lo..hi-1."""
        p = np.asarray(self.read_patched(lo, hi), dtype=np.float64).reshape(hi - lo, self.n_cells)
        base, gap = self.base[lo:hi, None], (self.source - self.base)[lo:hi, None]
        bad = self.degenerate[lo:hi, None] | ~np.isfinite(gap)
        with np.errstate(divide="ignore", invalid="ignore"):
            normalized = np.where(bad, np.nan, (p - base) / gap)
        return {"patched": p, "difference": p - base, "normalized": normalized}


def pair_values(read_patched: Callable[[int, int], np.ndarray], n_cells: int, m_base: np.ndarray,
                m_source: np.ndarray, min_gap: float, degenerate_share: float = 0.0) -> PairValues:
    """A pair is degenerate when |gap| <= min_gap or |gap| < degenerate_share * median |gap| over the
    dataset (a pair whose clean and corrupt metrics nearly agree: its per-pair ratio explodes)."""
    base = np.asarray(m_base, dtype=np.float64)
    src = np.asarray(m_source, dtype=np.float64)
    gap = src - base
    finite = np.isfinite(gap)
    typical = float(np.median(np.abs(gap[finite]))) if finite.any() else 0.0
    degenerate = finite & ((np.abs(gap) <= min_gap) | (np.abs(gap) < degenerate_share * typical))
    return PairValues(read_patched, len(base), n_cells, base, src, degenerate, typical)


def headline_stat(values: PairValues, comparison: str, aggregate: str) -> SumsStat:
    """The weighted statistic behind the table's `value` (entoscope.stats): see the module docstring."""
    n, U = values.n, values.n_cells
    if comparison in ("absolute", "difference"):
        column = COMPARISON_COLUMN[comparison]
        return streamed_mean(n, U, lambda lo, hi: values.block(lo, hi)[column])
    if aggregate == "mean_of_ratios":  # degenerate pairs are NaN: left out
        return streamed_mean(n, U, lambda lo, hi: values.block(lo, hi)["normalized"])
    gap = values.source - values.base
    return RatioStat.streamed(n, U, lambda lo, hi: (values.block(lo, hi)["difference"], gap[lo:hi]), shared_den=True)


def site_table(values: PairValues, sites: pd.DataFrame, comparison: str, aggregate: str,
               stats: Stats, seed: int, extra: dict[str, Any]) -> tuple[pd.DataFrame, Summary]:
    """One row per unit: the headline `value` with its interval, p/q-values and influence, the other
    aggregates, and the counts. Also returns the headline's Summary."""
    summary = summarise(headline_stat(values, comparison, aggregate), stats, seed)
    effect = summary if comparison != "absolute" else summarise(headline_stat(values, "difference", aggregate),
                                                                 stats, seed)
    table = sites.copy()
    for key, col in summary.columns("value").items():
        table[key] = col
    if comparison == "absolute":  # the test is of the difference from the base run: its p and its interval
        table["difference_ci_low"], table["difference_ci_high"] = effect.ci_low, effect.ci_high
    table["value_fragile"] = fragile(summary, stats.influence_share)
    for key, col in significance_columns(effect, "value", stats).items():
        table[key] = col
    table["ci_level"] = stats.ci_level
    U, keep = values.n_cells, ~values.degenerate
    chosen = COMPARISON_COLUMN[comparison]

    def descriptive(lo: int, hi: int) -> np.ndarray:  # [rows, 4U]: the chosen spread, patched, difference, normalized
        b = values.block(lo, hi)
        spread = np.where(keep[lo:hi, None], b[chosen], np.nan) if comparison == "normalized" else b[chosen]
        return np.concatenate([spread, b["patched"], b["difference"], b["normalized"]], axis=1)
    m = column_moments(values.n, 4 * U, descriptive)
    with np.errstate(invalid="ignore", divide="ignore"):
        table["value_std"] = m.std[:U]
        table["patched_mean"] = m.mean[U:2 * U]
        table["difference_mean"] = m.mean[2 * U:3 * U]
        table["normalized_mean"] = m.mean[3 * U:]
        gap_of_means = np.mean(values.source) - np.mean(values.base) if np.isfinite(values.source).all() \
            else np.nan
        table["normalized_of_means"] = (m.mean[U:2 * U] - values.base.mean()) / gap_of_means \
            if np.isfinite(gap_of_means) and gap_of_means != 0 else np.nan
    table["base_mean"] = float(values.base.mean())
    table["source_mean"] = float(np.nanmean(values.source)) if np.isfinite(values.source).any() else np.nan
    table["n_prompts"] = values.n
    table["n_degenerate"] = int(values.degenerate.sum())
    for key, value in extra.items():
        table[key] = value
    return table, summary


def prompt_table(values: dict[str, np.ndarray], sites: pd.DataFrame, examples: np.ndarray,
                 positions: np.ndarray, tokens: np.ndarray) -> pd.DataFrame:
    """One row per (example, unit), examples in dataset order; values: {"patched", "difference",
    "normalized"} [E, U] and {"base", "source", "degenerate"} [E]; positions/tokens [E, U] (NaN/'' if none)."""
    E, U = values["patched"].shape
    frame = pd.DataFrame({"example": np.repeat(examples, U)})
    for col in sites.columns:
        frame[col] = np.tile(sites[col].to_numpy(), E)
    frame["token_position"] = positions.reshape(-1)
    frame["token"] = tokens.reshape(-1)
    frame["base_metric"] = np.repeat(values["base"], U)
    frame["source_metric"] = np.repeat(values["source"], U)
    frame["patched_metric"] = values["patched"].reshape(-1)
    frame["difference"] = values["difference"].reshape(-1)
    frame["normalized"] = values["normalized"].reshape(-1)
    frame["degenerate"] = np.repeat(values["degenerate"], U)
    return frame
