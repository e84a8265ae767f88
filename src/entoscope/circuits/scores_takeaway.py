"""Takeaways of DLA and head-score results, computed from their tables (with intervals)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stats import value_with_ci


def dla_takeaway(result: Any, top: int = 3) -> str:
    """The components writing most directly to the metric, with intervals, and the share of the model's mean
    metric they carry together (a ratio of means over prompts, with its bootstrap interval)."""
    from ..stats import Stats, ratio_stat, summarise

    t = result.table
    if not len(t) or "mean" not in t:
        return ""
    strongest = t.reindex(t["mean"].abs().sort_values(ascending=False).index).head(top)
    cells = "; ".join(f"{r['component']} {value_with_ci(r, 'mean', '+.2f')}" for _, r in strongest.iterrows())
    n = int(t["n_prompts"].iloc[0])
    text = f"The components writing most directly to the {result.extra.get('metric', 'metric')}: {cells}"
    pp, identity = result.per_prompt, result.extra.get("identity")
    if pp is not None and identity is not None and len(identity) == n:
        grid = pp.pivot_table(index="example", columns="component", values="contribution", aggfunc="first")
        num = grid[list(strongest["component"])].sum(axis=1).to_numpy(dtype=float)[:, None]
        den = identity.sort_values("example")["value"].to_numpy(dtype=float)[:, None]
        if np.all(np.isfinite(num)) and abs(den.mean()) > 1e-9:
            s = summarise(ratio_stat(num, den), Stats(), seed=0)
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
