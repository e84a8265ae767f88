"""The report's lens section: the logit lens on IOI prompts, by layer, at the last positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ..section import Section, result_html, run_saved


@register("report_section", "lens")
def lens_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...lens import Lens
    from ...sites import Sites

    op = Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions="-8:"))
    result = run_saved(op, model, {"task": "ioi", "n": 8 if quick else 32, "seed": 7}, folder, folder.parent)
    return Section("logit lens on IOI (last 8 positions)", result.takeaway or _lead(result), result_html(result, lead=False),
                   terms=("logit lens", "KL(final || lens)", "95% interval"))


def _lead(result: Any) -> str:
    t = result.table
    last = t[t["position"] == t["position"].max()].sort_values("layer")
    first = last[last["target_top1"] >= 0.5]
    when = (f"the answer becomes the lens's top token for most prompts from layer {int(first['layer'].iloc[0])} on"
            if len(first) else "the answer is never the lens's top token for most prompts")
    return (f"At the last position {when}; the answer's mean probability through the lens rises from "
            f"{last['target_prob_mean'].iloc[0]:.3f} (layer {int(last['layer'].iloc[0])}) to "
            f"{last['target_prob_mean'].iloc[-1]:.3f} (layer {int(last['layer'].iloc[-1])}), over "
            f"{int(last['n_prompts'].iloc[0])} prompts.")
