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
its p-value against no effect (`value_p`; for "absolute", of the difference) and Benjamini-Hochberg
q-value over the table's cells (`value_q`, `significant` at `stats.fdr`), and the leave-one-out
influence of its most influential prompt (`value_influence`, `value_influential_prompt`,
`value_fragile`). docs/statistics.md has the details.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from torch import Tensor

from ..stats import Stats, Summary, benjamini_hochberg, fragile, mean_stat, ratio_stat, summarise

COMPARISON_COLUMN = {"absolute": "patched", "difference": "difference", "normalized": "normalized"}


def per_pair(patched: Tensor, m_base: Tensor, m_source: Tensor, min_gap: float,
             degenerate_share: float = 0.0) -> dict[str, np.ndarray]:
    """[E, U] arrays of every comparison, and the [E] degenerate flags.

    A pair is degenerate when |gap| <= min_gap or |gap| < degenerate_share * median |gap| over the
    dataset (a pair whose clean and corrupt metrics nearly agree: its per-pair ratio explodes)."""
    p = patched.double().numpy()
    base = m_base.double().numpy()[:, None]
    src = m_source.double().numpy()[:, None]
    gap = src - base
    finite = np.isfinite(gap)
    typical = float(np.median(np.abs(gap[finite]))) if finite.any() else 0.0
    degenerate = finite & ((np.abs(gap) <= min_gap) | (np.abs(gap) < degenerate_share * typical))
    with np.errstate(divide="ignore", invalid="ignore"):
        normalized = np.where(degenerate | ~finite, np.nan, (p - base) / gap)
    return {"patched": p, "difference": p - base, "normalized": normalized, "degenerate": degenerate[:, 0],
            "base": base[:, 0], "source": src[:, 0], "typical_gap": typical}


def headline_stat(values: dict[str, np.ndarray], comparison: str, aggregate: str) -> Any:
    """The weighted statistic behind the table's `value` (entoscope.stats): see the module docstring."""
    if comparison == "absolute":
        return mean_stat(values["patched"])
    if comparison == "difference":
        return mean_stat(values["difference"])
    if aggregate == "mean_of_ratios":
        return mean_stat(values["normalized"])  # degenerate pairs are NaN: left out
    return ratio_stat(values["difference"], values["source"] - values["base"])


def site_table(values: dict[str, np.ndarray], sites: pd.DataFrame, comparison: str, aggregate: str,
               stats: Stats, seed: int, extra: dict[str, Any]) -> tuple[pd.DataFrame, Summary]:
    """One row per unit: the headline `value` with its interval, p/q-values and influence, the other
    aggregates, and the counts. Also returns the headline's Summary."""
    summary = summarise(headline_stat(values, comparison, aggregate), stats, seed)
    effect = summary if comparison != "absolute" else summarise(mean_stat(values["difference"]), stats, seed)
    q = benjamini_hochberg(effect.p_value)
    table = sites.copy()
    for key, col in summary.columns("value").items():
        table[key] = col
    table["value_fragile"] = fragile(summary, stats.influence_share)
    table["value_q"] = q
    table["significant"] = np.where(np.isfinite(q), q <= stats.fdr, False)
    table["ci_level"] = stats.ci_level
    keep = ~values["degenerate"]
    chosen = values[COMPARISON_COLUMN[comparison]]
    with np.errstate(invalid="ignore", divide="ignore"):
        table["value_std"] = _std(chosen[keep] if comparison == "normalized" else chosen)
        table["patched_mean"] = values["patched"].mean(0)
        table["difference_mean"] = values["difference"].mean(0)
        table["normalized_mean"] = _mean(values["normalized"][keep])
        gap_of_means = np.mean(values["source"]) - np.mean(values["base"]) if np.isfinite(values["source"]).all() \
            else np.nan
        table["normalized_of_means"] = (values["patched"].mean(0) - values["base"].mean()) / gap_of_means \
            if np.isfinite(gap_of_means) and gap_of_means != 0 else np.nan
    table["base_mean"] = float(values["base"].mean())
    table["source_mean"] = float(np.nanmean(values["source"])) if np.isfinite(values["source"]).any() else np.nan
    table["n_prompts"] = len(values["base"])
    table["n_degenerate"] = int(values["degenerate"].sum())
    for key, value in extra.items():
        table[key] = value
    return table, summary


def _mean(x: np.ndarray) -> np.ndarray:
    if x.shape[0] == 0:
        return np.full(x.shape[1], np.nan)
    with np.errstate(invalid="ignore"):
        return np.nanmean(x, axis=0) if np.isnan(x).any() else x.mean(0)


def _std(x: np.ndarray) -> np.ndarray:
    if x.shape[0] == 0:
        return np.full(x.shape[1], np.nan)
    with np.errstate(invalid="ignore"):
        return np.nanstd(x, axis=0) if np.isnan(x).any() else x.std(0)


def prompt_table(values: dict[str, np.ndarray], sites: pd.DataFrame, examples: np.ndarray,
                 positions: np.ndarray, tokens: np.ndarray) -> pd.DataFrame:
    """One row per (example, unit), examples in dataset order; positions/tokens [E, U] (NaN/'' if none)."""
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
