"""The lens result's takeaway: when the answer appears through the lens, with intervals, at the last position."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..stats import value_with_ci


def last_position_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the last position asked for (the largest offset or index; a role named END or last)."""
    if "position" not in table or table["position"].isna().all():
        return table
    positions = list(dict.fromkeys(table["position"]))
    numeric = [p for p in positions if isinstance(p, (int, float)) or str(p).lstrip("-").isdigit()]
    named = [p for p in positions if p not in numeric]
    last = next((p for p in named if str(p) in ("END", "last")), None)
    if last is None:
        last = max(numeric, key=float) if numeric else positions[-1]
    return table[table["position"] == last]


def lens_takeaway(result: Any) -> str:
    t = result.table
    if not len(t) or "layer" not in t:
        return ""
    rows = last_position_rows(t).sort_values("layer")
    first, final = rows.iloc[0], rows.iloc[-1]
    n = int(first["n_prompts"]) if "n_prompts" in first else 0
    if "target_prob_mean" in rows:
        top = rows[rows["target_top1"] >= 0.5] if "target_top1" in rows else rows.iloc[:0]
        when = (f"the answer is the lens's top token for most prompts from layer {int(top['layer'].iloc[0])} on"
                if len(top) else "the answer is never the lens's top token for most prompts")
        return (f"At the last position {when}; the answer's mean probability through the lens is "
                f"{value_with_ci(first, 'target_prob_mean', '.3g')} at layer {int(first['layer'])} and "
                f"{value_with_ci(final, 'target_prob_mean', '.3g')} at layer {int(final['layer'])} "
                f"(95% intervals over {n} prompts).")
    if "kl_mean" in rows:
        return (f"At the last position KL(final || lens) falls from {value_with_ci(first, 'kl_mean', '.3g')} nats at layer "
                f"{int(first['layer'])} to {value_with_ci(final, 'kl_mean', '.3g')} at layer {int(final['layer'])} "
                f"(95% intervals over {n} prompts).")
    return ""
