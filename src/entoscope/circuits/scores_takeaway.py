"""Takeaways of DLA and head-score results, computed from their tables (with intervals)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stats import value_with_ci


def dla_takeaway(result: Any, top: int = 3) -> str:
    """The components writing most directly to the metric, with intervals, and the share of the model's mean
    metric they carry together (a ratio of means over prompts, with its bootstrap interval)."""
    from ..stats import RatioStat, Stats, summarise

    t = result.table
    if not len(t) or "mean" not in t:
        return ""
    strongest = t.reindex(t["mean"].abs().sort_values(ascending=False).index).head(top)
    cells = "; ".join(f"{r['component']} {value_with_ci(r, 'mean', '+.2f')}" for _, r in strongest.iterrows())
    n = int(t["n_prompts"].iloc[0])
    text = f"The components writing most directly to the {result.extra.get('metric', 'metric')}: {cells}"
    read, identity = result.extra.get("contribution_blocks"), result.extra.get("identity")
    if read is not None and identity is not None and len(identity) == n:
        top = strongest.index.to_numpy()  # table rows follow the components' order
        value = identity.sort_values("example")["value"].to_numpy(dtype=float)
        stat = RatioStat.streamed(n, 1, lambda lo, hi: (np.asarray(read(lo, hi), float)[:, top].sum(1, keepdims=True),
                                                        value[lo:hi]), shared_den=True)
        s = summarise(stat, Stats(), seed=0)
        if np.isfinite(s.value[0]) and abs(value.mean()) > 1e-9:
            text += (f". Together they carry {s.value[0]:.0%} [{s.ci_low[0]:.0%}, {s.ci_high[0]:.0%}] of the model's "
                     "mean value (ratio of means)")
    return text + f" (95% intervals over {n} prompts)."


def head_scores_takeaway(result: Any) -> str:
    """The strongest head of each kind, with its interval."""
    t = result.table
    if not len(t) or "score" not in t:
        return ""
    best = t.sort_values("score", ascending=False).groupby("kind", sort=False).head(1)
    cells = "; ".join(f"{r['kind'].replace('_', '-')} a{int(r['layer'])}.h{int(r['head'])} {value_with_ci(r, 'score', '.2f')}"
                      for _, r in best.iterrows())
    return f"Strongest head of each kind (score, 1 = ideal; 95% intervals over {int(t['n_prompts'].iloc[0])} prompts): {cells}."
