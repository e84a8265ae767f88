"""Takeaway sentences of circuit results (Circuits, information flow routes), computed from their numbers."""

from __future__ import annotations

from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder

SUMMARY = "summary.json"  # the circuit's summary, saved beside its table


def circuit_takeaway(result: Any) -> Takeaway | str:
    """How big the circuit is, how much of the metric it recovers (with its interval), its edges of largest
    |score| (with intervals and q), and how stable it is over resamples of the prompts."""
    s, t = result.extra["summary"], result.table
    kept = t[t["in_circuit"].astype(bool)] if "in_circuit" in t else t.iloc[:0]
    b = TakeawayBuilder(key="edge")
    b.say("The circuit keeps ")
    b.quote(s, "n_kept", fmt="d", name=False, key=(), source=SUMMARY, interval=False)
    b.say(" of ")
    b.quote(s, "n_edges_total", fmt="d", name=False, key=(), source=SUMMARY, interval=False)
    b.say(f" edges ({s['method']}, metric {s['metric']})")
    if "faithfulness" in s:
        b.say(" and recovers ")
        b.quote(s, "faithfulness", name=False, key=(), source=SUMMARY)
        b.say(" of the metric (faithfulness)")
    b.say(".")
    if len(kept) and "score" in kept:
        b.say(" Its edges of ")
        word = b.qualify("largest |score|", "top_by_abs", condition="in_circuit")
        b.say(": ")
        refs = b.ranking(kept, "score", 3, fmt="+.2g")
        b.refer(word, refs)
        if len(refs) > 1:
            b.say("; ")
            b.separation(refs[0], refs[1], above="the first stands out (its interval lies further from 0 than the second's)",
                         overlap="the first two intervals overlap")
        b.say(".")
    if s.get("cpr") is not None and s.get("cpr") == s.get("cpr"):
        b.say(" Over the edge fractions: CPR ")
        b.quote(s, "cpr", name=False, key=(), source=SUMMARY)
        b.say(" (higher is better), CMD ")
        b.quote(s, "cmd", name=False, key=(), source=SUMMARY)
        b.say(" (lower is better).")
    if "stability_jaccard" in s:
        b.say(" Over ")
        b.quote(s, "stability_resamples", fmt="d", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" resamples of the prompts the circuit is chosen again with mean Jaccard ")
        b.quote(s, "stability_jaccard", name=False, key=(), source=SUMMARY, interval=False)
        b.say("; ")
        b.quote(s, "n_stable", fmt="d", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" edges are kept in at least ")
        b.quote(s, "stability_share", fmt=".0%", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" of them.")
    return b.build()


def circuit_blank_note(method: str) -> str:
    if method == "acdc":
        return ("ACDC tests an edge only while its receiver is still in the circuit; an edge it never tested has no "
                "score (blank), and is outside the circuit")
    return "no interval without resampling (stats.n_boot 0), or no stability run (stability 0)"


def routes_takeaway(result: Any, top: int = 4) -> Takeaway | str:
    """The components the prompts' routes use most often: the share of prompts whose route uses each, with
    its Wilson score interval (a share of these prompts; the interval says how it would move on others)."""
    t = result.table
    if not len(t) or "in_route" not in t:
        return ""
    comps = t[t["kind"].isin(["attention", "mlp"])] if "kind" in t else t
    ranked = comps.sort_values(["in_route", "importance_mean"], ascending=False, kind="stable").head(top)
    b = TakeawayBuilder(key="component")
    b.say("The components used by the ")
    word = b.qualify("largest share", "top_by_value")
    b.say(" of the prompts' information flow routes (of ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say("; share of prompts with its ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" Wilson interval): ")
    refs = []
    for i, (_, row) in enumerate(ranked.iterrows()):
        b.say("; " if i else "")
        refs.append(b.quote(row, "in_route", fmt=".0%", q=False))
    b.refer(word, refs)
    b.say(".")
    return b.build()


def sign_labels(method: str) -> tuple[str, str]:
    """What a positive and a negative edge score mean for `method` (the circuit drawing's legend)."""
    if method == "acdc":
        return ("damage > 0: removing the edge hurts (metric down, or KL up)", "damage < 0: removing it helps")
    # EAP, EAP-IG and exact edge patching: score = metric(edge given its corrupt value) - metric(clean)
    return ("score > 0: corrupting the edge raises the metric", "score < 0: corrupting it lowers the metric")
