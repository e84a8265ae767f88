"""Feature DLA's takeaway: first how many rows pass the false discovery control (when none does, that is
said first, docs/pages.md), then the features of largest |mean direct contribution| with their intervals
and q, then the dictionaries' error term of largest |mean| (what the features leave unexplained). Every
number is a quoted cell, every qualifier a rule of results/claims.py."""

from __future__ import annotations

from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder


def feature_dla_takeaway(result: Any, metric: str = "metric", top: int = 3) -> Takeaway | str:
    t = result.table
    if not len(t) or "mean" not in t or "kind" not in t:
        return ""
    b = TakeawayBuilder(key="component")
    significant = int(t["significant"].sum()) if "significant" in t else 0
    if "significant" in t and not significant:
        fdr = ((result.manifest or {}).get("config", {}).get("stats", {}) or {}).get("fdr", 0.05)
        b.no_discovery(t, "mean", fdr, unit="rows")
    elif "significant" in t:
        b.count(significant, len(t), "significant", unit="rows (components, features and error terms)")
        b.say(" differ from zero at the false discovery control. ")
    features = t[t["kind"] == "feature"]
    if len(features):
        b.say("The features of ")
        word = b.qualify("largest |mean direct contribution|", "top_by_abs", condition="kind=feature")
        b.say(f" to the {metric} (")
        b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
        b.say(" intervals over ")
        b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
        b.say("): ")
        b.refer(word, b.ranking(features, "mean", top, fmt="+.3f"))
        b.say(".")
    if not b.lead_ended:
        b.end_lead()
    errors = t[t["kind"] == "error"]
    if len(errors):
        b.say(" What the dictionaries leave out, their error term of ")
        word = b.qualify("largest |mean|", "top_by_abs", condition="kind=error")
        b.say(": ")
        b.refer(word, b.ranking(errors, "mean", 1, fmt="+.3f"))
        b.say(".")
    return b.build()
