"""Attribution patching's top cells re-checked by exact patching on the same prompt pairs.

Attribution patching (Nanda 2023; Syed et al. 2023) estimates each cell's exact patching effect to first
order: it is exact for a metric linear in the activation and drifts where the model is not. Its largest
cells are the ones a reader will act on and the ones most likely to be off: on SmolLM2-135M the IOI map's
top cell, resid_pre.24@END, is estimated at 1.51 [1.25, 1.86] of the logit difference, a recovery beyond
the clean run's. So the report runs exact patching on the k cells of largest |estimate| (the same pairs,
metric, direction and patch value), and shows both, one row a cell:

    site                       the cell
    estimate, _ci_low/_high    attribution's value and interval (the screen's row)
    estimate_q                 its q over the whole map
    value, _ci_low/_high       exact patching's value and interval on the same pairs
    outside_range              the estimate lies outside [0, 1], beyond the corrupt (0) or the clean (1) run:
                               where a first-order estimate extrapolates (normalised maps only; else False)
    held                       exact patching's interval excludes 0 on the estimate's side
    n_prompts, ci_level

The exact run tests the same pairs the ranking was made on, so `held` re-checks the estimate's size and sign,
not a discovery: confirming one needs fresh prompts (`confirm`, confirm.py). The cells are patched as a
small grid (the top cells' layers x their positions or heads), or as coordinates where every axis is an
integer (heads: {layer, head}); only the k rows are read back.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from ..sites import Sites

RECHECK_K = 5
# a grid axis (Sites.over, canonical) -> (its column in the table, the Sites field that selects it)
AXES = {"layer": ("layer", "layers"), "pos": ("position", "positions"), "head": ("head", "heads"),
        "kv_head": ("kv_head", "heads"), "neuron": ("neuron", "neurons")}


def top_cells(table: pd.DataFrame, k: int) -> pd.DataFrame:
    """The k rows of largest |value| (ties: the table's order)."""
    order = table["value"].abs().sort_values(ascending=False, kind="stable").index
    return table.loc[order[:k]]


def _position(label: Any) -> int | str:
    """A position label back as a selection: a token index, END-k as -(k + 1), else the role's name."""
    text = str(label)
    if text.lstrip("-").isdigit():
        return int(text)
    m = re.fullmatch(r"END(?:-(\d+))?", text)
    return -(int(m.group(1) or 0) + 1) if m else text


def recheck_operation(op: Any, table: pd.DataFrame, k: int = RECHECK_K) -> Any:
    """An exact Patching of `op`'s configuration on the k cells of largest |value| of its table (module
    docstring), or None where its sites are not a grid of layer / position / head axes."""
    sites = op.sites
    if not isinstance(sites, Sites) or sites.groups is not None or sites.dictionary is not None \
            or sites.coords is not None or not all(ax in AXES and AXES[ax][0] in table for ax in sites.over):
        return None
    top = top_cells(table, k)
    exact = {"method": "exact", "confirm": None}
    columns = [AXES[ax][0] for ax in sites.over]
    if all(pd.api.types.is_integer_dtype(top[c]) for c in columns):
        coords = [{ax: int(row[c]) for ax, c in zip(sites.over, columns)} for _, row in top.iterrows()]
        return op.model_copy(update={**exact, "sites": sites.model_copy(update={"coords": coords})})
    chosen: dict[str, Any] = {}
    for ax, c in zip(sites.over, columns):
        values = list(dict.fromkeys(top[c].tolist()))
        chosen[AXES[ax][1]] = [_position(v) for v in values] if ax == "pos" else [int(v) for v in values]
    return op.model_copy(update={**exact, "sites": sites.model_copy(update=chosen)})


def recheck_table(screen: pd.DataFrame, exact: pd.DataFrame, k: int = RECHECK_K,
                  normalized: bool = True) -> pd.DataFrame:
    """Both methods on the screen's k cells of largest |value| (module docstring), in the screen's order."""
    top = top_cells(screen, k)
    again = exact.set_index("site").reindex(top["site"])
    out = pd.DataFrame({"site": top["site"].to_numpy()})
    for c in ("", "_ci_low", "_ci_high", "_q"):
        if f"value{c}" in top:
            out[f"estimate{c}"] = top[f"value{c}"].to_numpy(float)
    for c in ("", "_ci_low", "_ci_high"):
        out[f"value{c}"] = again[f"value{c}"].to_numpy(float)
    estimate = out["estimate"].to_numpy(float)
    out["outside_range"] = ((estimate < 0) | (estimate > 1)) if normalized else False
    low, high = out["value_ci_low"].to_numpy(float), out["value_ci_high"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        out["held"] = np.where(estimate >= 0, low > 0, high < 0)
    out["n_prompts"] = again["n_prompts"].to_numpy()
    out["ci_level"] = again["ci_level"].to_numpy()
    return out


def recheck_note(table: pd.DataFrame) -> str:
    """One line for the page: what the re-check is and how many cells it holds."""
    k, held, flagged = len(table), int(table["held"].sum()), int(table["outside_range"].sum())
    n = int(table["n_prompts"].iloc[0]) if k else 0
    return (f"exact patching of attribution's top {k} cells (largest |estimate|) on the same {n} pairs: {held} of {k} "
            f"hold (the exact interval excludes 0 on the estimate's side); {flagged} estimate(s) lie outside [0, 1], "
            "beyond the corrupt or the clean run, where a first-order estimate extrapolates. A re-check on the "
            "pairs the ranking was made on, not a confirmation on fresh prompts (confirm).")
