"""What a reader should take from a patching table, in a sentence or two computed from its numbers."""

from __future__ import annotations

from typing import Any


def patching_takeaway(result: Any) -> str:
    """The strongest cells with their intervals, how many survive the false-discovery control, and the cells
    one prompt carries (and the degenerate pairs left out of per-pair ratios)."""
    t = result.table
    if not len(t) or "value_ci_low" not in t:
        return ""
    n, level = int(t["n_prompts"].iloc[0]), int(round(100 * float(t["ci_level"].iloc[0])))
    what = result.extra.get("value_label", "value")
    top = t.reindex(t["value"].abs().sort_values(ascending=False).index).head(3)
    cells = "; ".join(f"{r.site} {r.value:.2f} [{r.value_ci_low:.2f}, {r.value_ci_high:.2f}]" for r in top.itertuples())
    text = f"Strongest cells of the {what} ({level}% bootstrap intervals over {n} prompts): {cells}."
    if "significant" in t:
        text += (f" {int(t['significant'].sum())} of {len(t)} cells differ from 0 at a 5% false discovery rate "
                 "(Benjamini-Hochberg).")
    fragile = t[t["value_fragile"].astype(bool)] if "value_fragile" in t else t.iloc[:0]
    if len(fragile):
        text += (f" {len(fragile)} cell(s) move by more than half their size when one prompt is left out "
                 f"(fragile: {', '.join(fragile.site.astype(str).head(6))}); read them as unsupported.")
    if "n_degenerate" in t and int(t["n_degenerate"].iloc[0]):
        text += (f" {int(t['n_degenerate'].iloc[0])} pair(s) have a clean-corrupt gap under 10% of the median and are "
                 "left out of the per-pair ratios; the value is the ratio of means over all pairs.")
    return text
