"""The probing result's takeaway: where the property is best decoded, against the control task, and what
the causal check shows against its random direction (every number a quoted cell with its interval,
every qualifier a rule of results/claims.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, excludes_zero, finite


def probing_takeaway(result: Any) -> Takeaway | str:
    t = result.table
    metric = next((m for m in ("r2", "accuracy") if f"test_{m}" in t), None)
    if not len(t) or metric is None:
        return ""
    col = f"test_{metric}"
    ranked = t.sort_values(col, ascending=False, kind="stable")
    best = ranked.iloc[0]
    b = TakeawayBuilder(key="site")
    # the lead: where it is decoded best, against the control task, and whether its selectivity says the property
    # is there; the details: the next site, the causal check, the held-out count
    b.say(f"The probe's held-out {'R²' if metric == 'r2' else metric} ")
    if len(ranked) > 1:
        second = ranked.iloc[1]
        apart = finite(best.get(f"{col}_ci_low"), second.get(f"{col}_ci_high")) and \
            best[f"{col}_ci_low"] > second[f"{col}_ci_high"]
        word = b.qualify("is highest" if apart else "has its highest point estimate",
                         "above" if apart else "overlaps")
    else:
        word, apart = None, False
    b.say(" at ")
    top = b.quote(best, col, name=f"{best['site']}:")
    control = f"control_{col}" in t and pd.notna(best.get(f"control_{col}"))
    sel = None
    if "selectivity" in t and pd.notna(best.get("selectivity")):
        b.say(", selectivity ")
        sel = b.quote(best, "selectivity", name=False)
    low, high = best.get("selectivity_ci_low"), best.get("selectivity_ci_high")
    if sel is not None and finite(low, high):
        if low > 0:
            b.say(", whose interval ")
            b.qualify("lies above 0", "above_zero", [sel])
            b.say(": the property is linearly present there.")
        else:
            b.say(", whose interval ")
            b.qualify("includes 0" if high >= 0 else "lies below 0", "includes_zero" if high >= 0 else "below_zero",
                      [sel])
            b.say(": the data do not show the property linearly present there.")
    else:
        b.say(".")
    b.end_lead()
    if control:  # said below the lead: the selectivity above is the difference
        b.say(" On the control task it scores ")
        b.quote(best, f"control_{col}", name=False)
        b.say(".")
    if word is not None:
        b.say(" Its interval lies above the next site's, " if apart else " The next site's interval overlaps it: ")
        b.refer(word, [top, b.quote(second, col)])
        b.say(".")
    if sel is not None and finite(low, high):
        b.say(" Selectivity is the held-out score less the control task's (a probe of random labels): what the probe "
              "finds beyond what it could learn from any labels.")
    _causal(b, t, (result.manifest or {}).get("config", {}).get("causal_check") or {})
    n = best.get("n_held_out")
    if n is not None and pd.notna(n):
        b.say(" (")
        b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
        b.say(" intervals over ")
        b.quote(best, "n_held_out", fmt="d", name=False, interval=False, q=False, after=" held-out prompts")
        b.say(".)")
    return b.build()


def _causal(b: TakeawayBuilder, t: pd.DataFrame, check: dict[str, Any]) -> None:
    """The causal check of each checked site: the probe direction's change of the metric against a random
    direction's, and whether the check singles the probe's direction out (rule `distinguished`)."""
    if "metric_change" not in t:
        return
    checked = t[t["metric_change"].notna()]
    for _, row in checked.iterrows():
        metric = row.get("metric", "metric")
        b.say(" Causal check")
        if check.get("sites", "best") == "best" and len(checked) == 1 and "selectivity" in t:
            b.say(" at the site of ")
            word = b.qualify("highest selectivity", "top_by_value")
            b.say(" (")
            b.refer(word, [b.quote(row, "selectivity", name=False)])
            b.say(")")
        b.say(": removing the probe's direction at ")
        probe = b.quote(row, "metric_change", fmt="+.3g", name=f"{row['site']} changes the {metric} by")
        if not pd.notna(row.get("random_metric_change")):
            b.say(".")
            continue
        b.say(", a random direction by ")
        rand = b.quote(row, "random_metric_change", fmt="+.3g", name=False)
        b.say("; ")
        if abs(row["random_metric_change"]) >= abs(row["metric_change"]):
            b.qualify("the random direction moves it as much or more", "random_as_large", [probe, rand])
            b.say(", so the check does not single out the probe's direction")
            b.say(" (paired difference ")
            b.quote(row, "metric_change_vs_random", fmt="+.3g", name=False)
            b.say(").")
            continue
        b.say("paired difference ")
        diff = b.quote(row, "metric_change_vs_random", fmt="+.3g", name=False)
        if excludes_zero(row.get("metric_change_vs_random_ci_low"), row.get("metric_change_vs_random_ci_high")):
            b.say(": removing the probe's direction ")
            b.qualify("moves the metric more than a random direction does", "distinguished", [probe, rand, diff])
            b.say(".")
        else:
            b.say(" ")
            b.qualify("includes 0", "includes_zero", [diff])
            b.say(", so the check does not single out the probe's direction.")
