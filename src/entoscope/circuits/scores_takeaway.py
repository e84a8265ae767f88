"""Takeaways of DLA and head-score results, computed from their tables (every number a quoted cell with
its interval, every qualifier a rule of results/claims.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..results.claims import Takeaway, TakeawayBuilder, most

TOP_SHARE_FILE = "top_share.json"


def top_share(result: Any, top: int = 3) -> dict[str, Any] | None:
    """The share of the model's mean metric the `top` components of largest |mean| make up together: a
    ratio of means over prompts (sum of their contributions / the metric), with its bootstrap interval.
    Computed once per result (kept in extra; DLA saves it as top_share.json)."""
    from ..stats import RatioStat, Stats, summarise

    if "top_share" in result.extra:
        return result.extra["top_share"]
    t = result.table
    read, identity = result.extra.get("contribution_blocks"), result.extra.get("identity")
    share = None
    n = int(t["n_prompts"].iloc[0]) if len(t) else 0
    if read is not None and identity is not None and len(identity) == n and n:
        rows = t["mean"].abs().sort_values(ascending=False, kind="stable").index[:top].to_numpy()  # components' order
        value = identity.sort_values("example")["value"].to_numpy(dtype=float)
        stat = RatioStat.streamed(n, 1, lambda lo, hi: (np.asarray(read(lo, hi), float)[:, rows].sum(1, keepdims=True),
                                                        value[lo:hi]), shared_den=True)
        stats = Stats(**((result.manifest or {}).get("config", {}).get("stats") or {}))
        s = summarise(stat, stats, seed=int((result.manifest or {}).get("seed") or 0))
        if np.isfinite(s.value[0]) and abs(value.mean()) > 1e-9:
            share = {"components": "+".join(t.loc[rows, "component"]), "share": float(s.value[0]),
                     "share_ci_low": float(s.ci_low[0]), "share_ci_high": float(s.ci_high[0]),
                     "ci_level": float(stats.ci_level), "n_prompts": n}
    result.extra["top_share"] = share
    return share


def dla_takeaway(result: Any, top: int = 3) -> Takeaway | str:
    """The components of largest |mean| direct contribution with intervals and q, whether the first stands
    out, and the share of the model's mean metric they make up together (a ratio of means)."""
    t = result.table
    if not len(t) or "mean" not in t:
        return ""
    metric = result.extra.get("metric", "metric")
    b = TakeawayBuilder(key="component")
    b.say("Components of ")
    word = b.qualify("largest |direct contribution|", "top_by_abs")
    b.say(f" to the {metric} (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say("): ")
    refs = b.ranking(t, "mean", top, fmt="+.2f")
    b.refer(word, refs)
    if len(refs) > 1:
        b.say("; ")
        b.separation(refs[0], refs[1], above="the first stands out (its interval lies further from 0 than the second's)",
                     overlap="the first two intervals overlap, so the data do not order them")
    b.say(".")
    share = top_share(result, top)
    if share is not None:
        b.say(" Together they make up ")
        if most(share["share"], share["share_ci_low"]):
            word = b.qualify("most", "most")
            b.say(f" of the model's mean {metric}: ")
            b.refer(word, [b.quote(share, "share", fmt=".0%", name=False, key=(), source=TOP_SHARE_FILE)])
        else:
            b.quote(share, "share", fmt=".0%", name=False, key=(), source=TOP_SHARE_FILE)
            b.say(f" of the model's mean {metric}")
        b.say(" (a ratio of means).")
    return b.build()


def head_scores_takeaway(result: Any, top: int = 3) -> Takeaway | str:
    """First how many head scores differ from chance (uniform attention over the causal keys; the false
    discovery control on `excess`, and when none does that is said first, docs/pages.md); then per kind, the
    heads that put most of their attention on their targets (rule `most` on the score and its interval), or
    the highest-scoring head where none does."""
    t = result.table
    if not len(t) or "score" not in t:
        return ""
    b = TakeawayBuilder(key=("kind", "site"))
    if "significant" in t:
        significant = int(t["significant"].sum())
        if not significant:
            fdr = ((result.manifest or {}).get("config", {}).get("stats", {}) or {}).get("fdr", 0.05)
            b.no_discovery(t, "excess", fdr, unit="head scores")
        else:
            b.count(significant, len(t), "significant", unit="head scores (kind x head)")
            b.say(" differ from chance (a head attending uniformly over the tokens up to its own) at the false discovery "
                  "control. ")
    b.say("Heads that put ")
    word = b.qualify("most of their attention", "most")
    b.say(" on their targets (a score of one: all of it; ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    if t["n_prompts"].nunique() == 1:
        b.say(" intervals over ")
        b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    else:
        b.say(" intervals over each kind's prompts")
    b.say("): ")
    refs = []
    for i, (kind, sub) in enumerate(t.groupby("kind", sort=False)):
        b.say("; " if i else "")
        ranked = sub.sort_values("score", ascending=False, kind="stable")
        passing = [r for _, r in ranked.head(top).iterrows() if most(r["score"], r.get("score_ci_low"))]
        words = kind.replace("_", "-")
        if passing:
            b.say(f"{words} ")
            for j, row in enumerate(passing):
                b.say(", " if j else "")
                refs.append(b.quote(row, "score"))
        else:
            none = b.qualify(f"no {words} head", "not_most")
            b.say(" (the ")
            highest = b.qualify("highest", "top_by_value", condition=f"kind={kind}")
            b.say(": ")
            q = b.quote(ranked.iloc[0], "score")
            b.refer(none, [q])
            b.refer(highest, [q])
            b.say(")")
    b.refer(word, refs)
    b.say(".")
    return b.build()
