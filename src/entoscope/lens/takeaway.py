"""The lens result's takeaway: when the answer appears through the lens, with intervals, at the last position
(every number a quoted cell, every qualifier a rule of results/claims.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, most


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


def lens_takeaway(result: Any) -> Takeaway | str:
    t = result.table
    if not len(t) or "layer" not in t:
        return ""
    rows = last_position_rows(t).sort_values("layer")
    first, final = rows.iloc[0], rows.iloc[-1]
    b = TakeawayBuilder(key="site")
    if "target_prob_mean" in rows:
        b.say("At the last position ")
        if "target_top1" in rows:
            passes = [bool(most(r["target_top1"], r.get("target_top1_ci_low"))) for _, r in rows.iterrows()]
            start = next((i for i in range(len(passes)) if all(passes[i:])), None)
            if start is not None:
                b.say("the answer is the lens's top token for ")
                word = b.qualify(f"most prompts from layer {int(rows.iloc[start]['layer'])} on", "most")
                b.say(" (share of prompts: ")
                refs = []
                for j, (_, r) in enumerate(rows.iloc[start:].iterrows()):
                    b.say(", " if j else "")
                    refs.append(b.quote(r, "target_top1", name=False, after=f" at layer {int(r['layer'])}"))
                b.refer(word, refs)
                b.say("); ")
            else:
                b.say("the answer is not the lens's top token for ")
                word = b.qualify("most prompts", "not_most")
                b.say(" at any layer (highest share: ")
                best = rows.loc[rows["target_top1"].astype(float).idxmax()]
                b.refer(word, [b.quote(best, "target_top1", name=False, after=f" at layer {int(best['layer'])}")])
                b.say("); ")
        b.say("the answer's mean probability through the lens is ")
        b.quote(first, "target_prob_mean", fmt=".3g", name=False, after=f" at layer {int(first['layer'])}")
        b.say(" and ")
        b.quote(final, "target_prob_mean", fmt=".3g", name=False, after=f" at layer {int(final['layer'])}")
    elif "kl_mean" in rows:
        b.say("At the last position KL(final || lens) is ")
        b.quote(first, "kl_mean", fmt=".3g", name=False, after=f" nats at layer {int(first['layer'])}")
        b.say(" and ")
        b.quote(final, "kl_mean", fmt=".3g", name=False, after=f" at layer {int(final['layer'])}")
    else:
        return ""
    b.say(" (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(first["n_prompts"], "n_prompts", unit="prompts")
    b.say(").")
    return b.build()
