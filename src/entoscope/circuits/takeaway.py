"""Takeaway sentences of circuit results (Circuits, information flow routes), computed from their numbers."""

from __future__ import annotations

from typing import Any

from ..stats import value_with_ci


def circuit_takeaway(result: Any) -> str:
    """How big the circuit is, how much of the metric it recovers (with its interval), its strongest edges,
    and how stable it is over resamples of the prompts."""
    s, t = result.extra["summary"], result.table
    kept = t[t["in_circuit"].astype(bool)] if "in_circuit" in t else t.iloc[:0]
    text = f"The circuit keeps {s['n_kept']} of {s['n_edges_total']} edges ({s['method']}, metric {s['metric']})"
    if "faithfulness" in s:
        text += f" and recovers {value_with_ci(s, 'faithfulness')} of the metric (faithfulness)"
    text += "."
    if len(kept) and "score" in kept:
        top = kept.reindex(kept["score"].abs().sort_values(ascending=False).index).head(3)
        text += " Strongest edges: " + ", ".join(f"{r.edge} ({r.score:+.2g})" for r in top.itertuples()) + "."
    if s.get("cpr") is not None and s.get("cpr") == s.get("cpr"):
        text += (f" Over the edge fractions: CPR {value_with_ci(s, 'cpr')} (higher is better), "
                 f"CMD {value_with_ci(s, 'cmd')} (lower is better).")
    if "stability_jaccard" in s:
        text += (f" Over {s['stability_resamples']} resamples of the prompts the circuit is chosen again with mean "
                 f"Jaccard {s['stability_jaccard']:.2f}; {s['n_stable']} edges are kept in at least "
                 f"{s['stability_share']:.0%} of them.")
    return text


def circuit_blank_note(method: str) -> str:
    if method == "acdc":
        return ("ACDC tests an edge only while its receiver is still in the circuit; an edge it never tested has no "
                "score (blank), and is outside the circuit")
    return "no interval without resampling (stats.n_boot 0), or no stability run (stability 0)"


def routes_takeaway(result: Any) -> str:
    """Which components the prompts' routes use most, and how often."""
    t = result.table
    if not len(t) or "in_route" not in t:
        return ""
    n = int(t["n_prompts"].iloc[0])
    comps = t[t["kind"].isin(["attention", "mlp"])] if "kind" in t else t
    top = comps.sort_values(["in_route", "importance_mean"], ascending=False).head(4)
    used = "; ".join(f"{r.component} in {r.in_route:.0%}" for r in top.itertuples())
    return (f"The components most often on the prompts' information flow routes (share of {n} prompts whose route "
            f"uses them): {used}.")


def sign_labels(method: str) -> tuple[str, str]:
    """What a positive and a negative edge score mean for `method` (the circuit drawing's legend)."""
    if method == "acdc":
        return ("damage > 0: removing the edge hurts (metric down, or KL up)", "damage < 0: removing it helps")
    # EAP, EAP-IG and exact edge patching: score = metric(edge given its corrupt value) - metric(clean)
    return ("score > 0: corrupting the edge raises the metric", "score < 0: corrupting it lowers the metric")
