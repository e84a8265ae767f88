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
    """The components of largest |mean| direct contribution with intervals and q and the share of the model's
    mean metric they make up together (a ratio of means): the lead; then whether the first stands out."""
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
    b.end_lead()
    b.first_two_apart(refs)
    return b.build()


NAMED = 6  # a kind's passing heads named in the lead at most (by their test's value); the table has them all
TARGETS = {"previous_token": "the token before", "duplicate_token": "the earlier copy of their token",
           "induction": "the token after the earlier copy of their token"}


def head_scores_takeaway(result: Any, top: int = NAMED) -> Takeaway | str:
    """Per kind, the heads that pass the kind's test (`passes`, head_scores.head_passes): with a control (duplicate-
    token, induction on repeated sequences), score - control above CONTROL_MARGIN, interval and all; else the
    `most` rule on the score. How many pass of the kind's heads, then up to `top` of them by the test's value,
    each with its interval; where none passes, that is said with the kind's best value. The lead is the counts
    (how many heads of each kind pass); the details name them. The count of heads that differ from chance
    (uniform attention) is not said: nearly every head of a trained model does."""
    t = result.table
    if not len(t) or "score" not in t:
        return ""
    if "passes" not in t:  # a table saved before the control
        from .head_scores import head_passes

        t = t.assign(passes=[head_passes(r) for r in t.to_dict("records")])
    b = TakeawayBuilder(key=("kind", "site"))
    b.say("Heads that pass their kind's test (one that heads of other kinds fail): ")
    for i, (kind, sub) in enumerate(t.groupby("kind", sort=False)):
        b.say(", " if i else "")
        b.say(kind.replace("_", "-") + " ")
        b.count(int(sub["passes"].astype(bool).sum()), len(sub), "passes", f"true&kind={kind}", unit="heads")
    b.say(".")
    b.end_lead()
    b.say(" By the test's value (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    if t["n_prompts"].nunique() == 1:
        b.say(" intervals over ")
        b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    else:
        b.say(" intervals over each kind's prompts")
    b.say("): ")
    said_control = False
    for i, (kind, sub) in enumerate(t.groupby("kind", sort=False)):
        b.say("; " if i else "")
        words = kind.replace("_", "-")
        controlled = "over_control" in sub and bool(np.isfinite(sub["over_control"].to_numpy(float)).any())
        column = "over_control" if controlled else "score"
        ranked = sub.sort_values(column, ascending=False, kind="stable")
        passing = ranked[ranked["passes"].astype(bool)]
        target = TARGETS.get(kind, "their targets")
        if controlled:
            b.say(f"{words}, attention on {target} above the same head's on the shuffled control" if not said_control
                  else f"{words}, the same on {target}")
            b.say(" ")
            word = b.qualify("by over a tenth of their attention" if not said_control else "by over a tenth",
                             "clears" if len(passing) else "none_clears", condition=f"kind={kind}")
            said_control = True
        else:
            b.say(f"{words}, ")
            word = b.qualify("most of their attention", "most" if len(passing) else "not_most")
            b.say(f" on {target}")
        b.say(": ")
        fmt = "+.2f" if controlled else ".2f"
        if len(passing):
            refs = []
            for j, (_, row) in enumerate(passing.head(top).iterrows()):
                b.say(", " if j else "")
                refs.append(b.quote(row, column, fmt=fmt))
            if len(passing) > top:
                b.say(" and the others in the table")
            b.refer(word, refs)
        else:
            b.say("none (the ")
            highest = b.qualify("highest", "top_by_value", condition=f"kind={kind}")
            b.say(": ")
            q = b.quote(ranked.iloc[0], column, fmt=fmt)
            b.refer(highest, [q])
            b.refer(word, [q])
            b.say(")")
    b.say(".")
    return b.build()
