"""What a reader should take from a patching table, in a sentence or two computed from its numbers
(every number a quoted cell, every qualifier a rule of results/claims.py)."""

from __future__ import annotations

from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder

TOP = 3
FRAGILE_NAMED = 6


def patching_takeaway(result: Any) -> Takeaway | str:
    """How many cells survive the false-discovery control (first, when none does: that null is the lead),
    the cells of largest |value| with their intervals and q (the lead where some do), whether the first
    stands out, the cells one prompt carries, and the degenerate pairs left out of per-pair ratios."""
    t = result.table
    if not len(t) or "value_ci_low" not in t:
        return ""
    b = TakeawayBuilder(key="site")
    what = result.extra.get("value_label", "value")
    significant = int(t["significant"].sum()) if "significant" in t else None
    fdr = (result.manifest.get("config", {}).get("stats", {}) or {}).get("fdr", 0.05) if result.manifest else 0.05
    if significant == 0:
        b.no_discovery(t, "value" if "difference_ci_low" not in t else "difference", fdr)
    b.say("Cells of ")
    word = b.qualify(f"largest |{what}|", "top_by_abs")
    b.say(" (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" bootstrap intervals over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say("): ")
    top = b.ranking(t, "value", TOP)
    b.refer(word, top)
    b.say(".")
    if not significant == 0:
        b.end_lead()
    b.first_two_apart(top)
    if significant:
        b.say(" ")
        b.count(significant, len(t), "significant", unit="cells")
        b.say(" differ from zero at a ")
        b.setting(fdr, "stats.fdr", fmt=".0%")
        b.say(" false discovery rate (Benjamini-Hochberg).")
    fragile = t[t["value_fragile"].astype(bool)] if "value_fragile" in t else t.iloc[:0]
    if len(fragile):
        b.say(" ")
        b.count(len(fragile), len(t), "value_fragile", unit="cells")
        b.say(" are fragile (leaving one prompt out moves them by more than half their size: ")
        for i, (_, row) in enumerate(fragile.head(FRAGILE_NAMED).iterrows()):
            b.say(", " if i else "")
            b.mark(row, "value_fragile")
        b.say(", ..." if len(fragile) > FRAGILE_NAMED else "")
        b.say("); read them as unsupported.")
    if "n_degenerate" in t and int(t["n_degenerate"].iloc[0]):
        b.say(" ")
        b.constant(t["n_degenerate"].iloc[0], "n_degenerate")
        b.say(" of the ")
        b.constant(t["n_prompts"].iloc[0], "n_prompts")
        b.say(" pairs are degenerate (clean-corrupt gap under ")
        b.setting(_share(result), "stats.degenerate_share", fmt=".0%")
        b.say(" of the median): left out of per-pair ratios, never out of the ratio of means.")
    return b.build()


def _share(result: Any) -> float:
    return float(((result.manifest or {}).get("config", {}).get("stats", {}) or {}).get("degenerate_share", 0.1))
