"""Comparisons of a patched metric with the unpatched runs, per prompt and over the dataset.

With m_base the metric of the run being patched, m_source that of the other run of the pair, and
m_patched that of the patched run (for attribution and integrated gradients: m_base + estimate):

    absolute    m_patched
    difference  m_patched - m_base                                  (the indirect effect)
    normalized  (m_patched - m_base) / (m_source - m_base)          0 = no effect, 1 = full recovery
                (denoising: of the clean run's metric; noising: 1 = as damaged as the corrupt run)

A pair with |m_source - m_base| <= min_gap has no normalised value: NaN in the per-prompt table,
`degenerate` True, and counted in `n_degenerate` (no warning, no inf). Over the dataset:
`normalized_mean` is the mean over the non-degenerate pairs; `normalized_of_means` is
(mean m_patched - mean m_base) / (mean m_source - mean m_base) over all pairs (Wang et al. 2022 style).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from torch import Tensor

COMPARISON_COLUMN = {"absolute": "patched", "difference": "difference", "normalized": "normalized"}


def per_pair(patched: Tensor, m_base: Tensor, m_source: Tensor, min_gap: float) -> dict[str, np.ndarray]:
    """[E, U] arrays of every comparison, and the [E] degenerate flags."""
    p = patched.double().numpy()
    base = m_base.double().numpy()[:, None]
    src = m_source.double().numpy()[:, None]
    gap = src - base
    degenerate = np.isfinite(gap) & (np.abs(gap) <= min_gap)
    with np.errstate(divide="ignore", invalid="ignore"):
        normalized = np.where(degenerate | ~np.isfinite(gap), np.nan, (p - base) / gap)
    return {"patched": p, "difference": p - base, "normalized": normalized, "degenerate": degenerate[:, 0],
            "base": base[:, 0], "source": src[:, 0]}


def site_table(values: dict[str, np.ndarray], sites: pd.DataFrame, comparison: str,
               extra: dict[str, Any]) -> pd.DataFrame:
    """One row per unit: the chosen comparison's mean and spread, and every other comparison."""
    keep = ~values["degenerate"]
    norm = values["normalized"][keep]
    chosen = values[COMPARISON_COLUMN[comparison]]
    chosen = chosen[keep] if comparison == "normalized" else chosen
    with np.errstate(invalid="ignore", divide="ignore"):
        gap_of_means = np.nanmean(values["source"]) - np.mean(values["base"]) if np.isfinite(values["source"]).any() \
            else np.nan
        table = sites.copy()
        table["value"] = _mean(chosen)
        table["value_std"] = _std(chosen)
        table["patched_mean"] = values["patched"].mean(0)
        table["difference_mean"] = values["difference"].mean(0)
        table["normalized_mean"] = _mean(norm)
        table["normalized_of_means"] = (values["patched"].mean(0) - values["base"].mean()) / gap_of_means \
            if np.isfinite(gap_of_means) and gap_of_means != 0 else np.nan
    table["base_mean"] = float(values["base"].mean())
    table["source_mean"] = float(np.nanmean(values["source"])) if np.isfinite(values["source"]).any() else np.nan
    table["n_prompts"] = len(values["base"])
    table["n_degenerate"] = int(values["degenerate"].sum())
    for key, value in extra.items():
        table[key] = value
    return table


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
