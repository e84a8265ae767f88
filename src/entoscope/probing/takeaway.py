"""The probing result's takeaway: where the property is best decoded, against the control task, with intervals."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..stats import value_with_ci


def probing_takeaway(result: Any) -> str:
    t = result.table
    metric = next((m for m in ("r2", "accuracy") if f"test_{m}" in t), None)
    if not len(t) or metric is None:
        return ""
    col = f"test_{metric}"
    best = t.loc[t[col].idxmax()]
    n = int(best["n_held_out"]) if "n_held_out" in best and pd.notna(best.get("n_held_out")) else None
    text = f"The probe's held-out {metric} is highest at {best['site']}: {value_with_ci(best, col)}"
    if f"control_{col}" in t and pd.notna(best.get(f"control_{col}")):
        text += f", against {value_with_ci(best, f'control_{col}')} on the control task"
    if "selectivity" in t and pd.notna(best.get("selectivity")):
        text += f" (selectivity {value_with_ci(best, 'selectivity')})"
    text += "."
    low = best.get("selectivity_ci_low")
    if low is not None and pd.notna(low):
        text += (" Its selectivity interval lies above 0: the property is linearly present there beyond what a "
                 "probe learns from random labels." if low > 0 else
                 " Its selectivity interval includes 0: the probe does not beat the control task there, so the "
                 "data do not show the property linearly present.")
    if n:
        text += f" (95% intervals over {n} held-out prompts.)"
    return text
