"""Takeaway sentences of circuit results (Circuits, information flow routes), computed from their numbers."""

from __future__ import annotations

from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder

SUMMARY = "summary.json"  # the circuit's summary, saved beside its table
CURVE = "faithfulness.csv"  # its faithfulness curve


def circuit_takeaway(result: Any) -> Takeaway | str:
    """How big the circuit is and how much of the metric it recovers (with its interval): the lead; then its
    edges of largest |score| (with intervals and q), and how stable it is over resamples of the prompts."""
    s, t = result.extra["summary"], result.table
    kept = t[t["in_circuit"].astype(bool)] if "in_circuit" in t else t.iloc[:0]
    b = TakeawayBuilder(key="edge")
    found = s.get("found")
    if found is None:
        b.say("The circuit keeps ")
        b.quote(s, "n_kept", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" of ")
        b.quote(s, "n_edges_total", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
        b.say(f" edges ({s['method']}, metric {s['metric']})")
        if s.get("n_kept") and s.get("n_kept_pruned") == 0:  # said before what it recovers: nothing, and why
            b.say(", none of them on a path from the input to the logits")
        if "faithfulness" in s:
            b.say(" and recovers ")
            b.quote(s, "faithfulness", name=False, key=(), source=SUMMARY)
            b.say(" of the metric (faithfulness)")
        b.say(".")
        b.end_lead()
    else:
        target_sentence(b, s, result.extra.get("curve"))
    if len(kept) and "score" in kept and found is not False:
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
        b.say(f" resamples of the prompts the {'circuit' if found is not False else 'best edge set'} is chosen again "
              "with mean Jaccard ")
        b.quote(s, "stability_jaccard", name=False, key=(), source=SUMMARY, interval=False)
        b.say("; ")
        b.quote(s, "n_stable", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" edges are kept in at least ")
        b.quote(s, "stability_share", fmt=".0%", name=False, key=(), source=SUMMARY, interval=False)
        b.say(" of them.")
    return b.build()


def target_sentence(b: TakeawayBuilder, s: dict[str, Any], curve: Any = None) -> None:
    """selection "target" (circuits/search.py): the circuit found, its size before and after pruning and its
    faithfulness; or that no edge set of at most the budget reached the target, and the best one read."""
    if s["found"]:
        def how(b: TakeawayBuilder) -> None:
            b.say(" edges (the top ")
            b.quote(s, "n_top", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
            b.say(f" by |score|, {s['method']}, metric {s['metric']}, pruned to the paths from the input to the "
                  "logits) and recovers ")
        found_sentence(b, s, SUMMARY, opening="The smallest circuit the search found to recover ", of="the metric",
                       how=how, end=" (faithfulness).")
        return
    b.say("No circuit of ")
    budget = b.quote(s, "max_edges", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
    b.say(" edges or fewer reaches the target faithfulness ")
    target = b.quote(s, "faithfulness_target", fmt="g", name=False, key=(), source=SUMMARY, interval=False)
    b.say(f" ({s['method']}, metric {s['metric']}): the top-n edge sets by |score| the search read up to it recover ")
    word = b.qualify("at most", "none_reaches")
    b.say(" ")
    f = b.quote(s, "faithfulness", name=False, key=(), source=SUMMARY)
    b.say(" (the top ")
    b.quote(s, "n_top", fmt=",d", name=False, key=(), source=SUMMARY, interval=False)
    b.say(")")
    b.refer(word, [f, target, budget])
    b.say(".")
    b.end_lead()
    beyond_budget(b, curve, target, opening=" The faithfulness curve ", end=".")


def found_sentence(b: TakeawayBuilder, s: dict[str, Any], source: str, *, opening: str, of: str,
                   how: Any = None, end: str = ".") -> None:
    """The lead of a circuit found (summary `s` of selection "target", read from `source`): "<opening>at least
    <target> of <of> keeps <n_kept> of <n_edges_total>" then `how(b)` (default " edges and recovers ") and its
    faithfulness with its interval (rule `reaches_target`), then `end`; the lead ends there."""
    b.say(opening)
    word = b.qualify("at least", "reaches_target")
    b.say(" ")
    target = b.quote(s, "faithfulness_target", fmt="g", name=False, key=(), source=source, interval=False)
    b.say(f" of {of} keeps ")
    b.quote(s, "n_kept", fmt=",d", name=False, key=(), source=source, interval=False)
    b.say(" of ")
    b.quote(s, "n_edges_total", fmt=",d", name=False, key=(), source=source, interval=False)
    if how is None:
        b.say(" edges and recovers ")
    else:
        how(b)
    f = b.quote(s, "faithfulness", name=False, key=(), source=source)
    b.refer(word, [f, target])
    b.say(end)
    b.end_lead()


def beyond_budget(b: TakeawayBuilder, curve: Any, target: int, source: str = CURVE, *,
                  opening: str = ", and the curve ", end: str = "") -> None:
    """Where no circuit was found within the budget: the first point of the faithfulness curve that reaches the
    target (rule `first_reaches`), so the reader sees how many edges it takes; every edge, said as such.
    `opening` and `end` frame the clause (a sentence of its own: " The faithfulness curve ", ".")."""
    if curve is None or not len(curve):
        return
    reached = curve[curve["faithfulness"] >= b.value(target)].sort_values("n_edges", kind="stable")
    if not len(reached):
        return
    row = reached.iloc[0]
    b.say(opening)
    word = b.qualify("first reaches", "first_reaches")
    if float(row["fraction"]) == 1.0:  # every edge: the clean run
        b.say(" it only with all ")
        b.refer(word, [b.quote(row, "n_edges", fmt=",d", name=False, interval=False, key="fraction", source=source,
                               after=" edges"), target])
        b.say(end)
        return
    b.say(" it at ")
    n = b.quote(row, "n_edges", fmt=",d", name=False, interval=False, key="fraction", source=source, after=" edges")
    b.say(" (")
    b.quote(row, "faithfulness", name=False, key="fraction", source=source)
    b.say(")" + end)
    b.refer(word, [n, target])


def circuit_blank_note(method: str) -> str:
    if method == "acdc":
        return ("ACDC tests an edge only while its receiver is still in the circuit; an edge it never tested has no "
                "score (blank), and is outside the circuit")
    return "no interval without resampling (stats.n_boot 0), or no stability run (stability 0)"


LEAD_ROUTES = 2  # routes named in the lead; the others follow in the details


def routes_takeaway(result: Any, top: int = 6, always_named: int = 3) -> Takeaway | str:
    """The routes that move information from earlier tokens into the prediction, then, apart, what every route
    uses. First the `top` components of largest mean importance of kept attention edges from an earlier token
    into each prompt's last position (`moved_importance_mean`, with its interval, and the share of prompts whose
    route uses the component, with its Wilson interval); then, said once, how many components are on every
    prompt's route (always on: a route through them tells one prompt from another nothing), the first
    `always_named` by mean importance. The lead names the first LEAD_ROUTES routes; the others, what the numbers
    are and the always-on components follow. A table saved before `moved_importance_mean`: the components on the
    largest share of routes."""
    t = result.table
    if not len(t) or "in_route" not in t:
        return ""
    comps = t[t["kind"].isin(["attention", "mlp"])] if "kind" in t else t
    b = TakeawayBuilder(key="component")
    if "moved_importance_mean" not in comps:
        ranked = comps.sort_values(["in_route", "importance_mean"], ascending=False, kind="stable").head(top)
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
    moving = comps[comps["moved_importance_mean"] > 0]
    b.say("Routes into the prediction from earlier tokens: ")
    if len(moving):
        word = b.qualify("the largest", "top_by_value")
        b.say(" run through ")
        refs = []
        for i, (_, row) in enumerate(moving.sort_values("moved_importance_mean", ascending=False,
                                                        kind="stable").head(top).iterrows()):
            if i == LEAD_ROUTES:
                b.say(".")
                b.end_lead()
                b.say(" Then ")
            elif i:
                b.say("; ")
            refs.append(b.quote(row, "moved_importance_mean", fmt=".2f", q=False, after=", on "))
            b.quote(row, "in_route", fmt=".0%", name=False, q=False,
                    after=" of the prompts' routes" if i == 0 else " of routes")
        b.refer(word, refs)
    else:
        b.say("none above tau")
    b.say(".")
    if not b.lead_ended:
        b.end_lead()
    b.say(" (Attention edges into each prompt's last position; mean importance over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(", ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals.)")
    always = comps[comps["in_route"] >= 1]
    if len(always):
        b.say(" Always on, said once: ")
        b.count(len(always), len(comps), "in_route", ">=1", unit="components")
        b.say(" are on every prompt's route (")
        word = b.qualify("largest", "top_by_value", condition="in_route>=1")
        b.say(" mean importance of their kept edges: ")
        refs = []
        for i, (_, row) in enumerate(always.sort_values("importance_mean", ascending=False,
                                                        kind="stable").head(always_named).iterrows()):
            b.say(", " if i else "")
            refs.append(b.quote(row, "importance_mean", fmt=".2f", q=False))
        b.refer(word, refs)
        b.say(").")
    return b.build()


def sign_labels(method: str) -> tuple[str, str]:
    """What a positive and a negative edge score mean for `method` (the circuit drawing's legend)."""
    if method == "acdc":
        return ("damage > 0: removing the edge hurts (metric down, or KL up)", "damage < 0: removing it helps")
    # EAP, EAP-IG and exact edge patching: score = metric(edge given its corrupt value) - metric(clean)
    return ("score > 0: corrupting the edge raises the metric", "score < 0: corrupting it lowers the metric")
