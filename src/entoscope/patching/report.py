"""The patching section of `entoscope report`: the IOI and greater-than circuits' patching maps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..registry import register


def _examples(quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    n = 8 if quick else 32
    return [
        ("IOI: denoising the residual stream at each name and the last token (normalised logit difference)",
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"],
                    "positions": ["IO", "S1", "S1+1", "S2", "S2+1", "END"]},
          "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("IOI: denoising each head's output (normalised logit difference)",
         {"sites": {"activation": "z", "over": ["layer", "head"]}, "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("greater-than: denoising each MLP's output at the start year (XX, YY) and the last token "
         "(normalised probability difference)",
         {"sites": {"activation": "mlp_out", "over": ["layer", "position"], "positions": ["XX", "YY", "END"]},
          "metric": "prob_diff"},
         {"task": "greater_than", "n": n, "seed": 7}),
    ]


def takeaway(result: Any) -> str:
    """What a reader should take from a patching table, from its numbers: the strongest cells with their
    intervals, how many survive the false-discovery control, and the cells one prompt carries."""
    t = result.table
    n, level = int(t["n_prompts"].iloc[0]), int(round(100 * float(t["ci_level"].iloc[0])))
    top = t.reindex(t["value"].abs().sort_values(ascending=False).index).head(3)
    cells = "; ".join(f"{r.site} {r.value:.2f} [{r.value_ci_low:.2f}, {r.value_ci_high:.2f}]" for r in top.itertuples())
    text = (f"Strongest cells ({level}% bootstrap intervals over {n} prompts): {cells}. "
            f"{int(t['significant'].sum())} of {len(t)} cells differ from 0 at a 5% false discovery rate "
            "(Benjamini-Hochberg).")
    fragile = t[t["value_fragile"]]
    if len(fragile):
        text += (f" {len(fragile)} cell(s) move by more than half their size when one prompt is left out "
                 f"(fragile: {', '.join(fragile.site.astype(str).head(6))}); read them as unsupported.")
    if int(t["n_degenerate"].iloc[0]):
        text += (f" {int(t['n_degenerate'].iloc[0])} pair(s) have a clean-corrupt gap under 10% of the median and are "
                 "left out of the per-pair ratios (normalized_mean); the value is the ratio of means over all pairs.")
    return text


@register("report_section", "patching")
def patching_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    """Exact denoising on IOI and greater-than; the first result is saved in `folder`, the others below it."""
    from ..report import examples_html
    from .operation import Patching

    html = examples_html(Patching, model, _examples(quick), folder, max_rows=6, note=takeaway)
    return ("activation patching (exact, denoising)", html)
