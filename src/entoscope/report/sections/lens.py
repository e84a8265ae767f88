"""The report's lens section: the logit lens on IOI prompts, by layer, at the last positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ..section import Section, lead_of, result_html, run_saved


@register("report_section", "lens")
def lens_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...lens import Lens
    from ...sites import Sites

    op = Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions="-8:"))
    result = run_saved(op, model, {"task": "ioi", "n": 8 if quick else 32, "seed": 7}, folder, folder.parent)
    return Section("logit lens on IOI (last 8 positions)", lead_of(result, folder, folder.parent),
                   result_html(result, lead=False),
                   terms=("logit lens", "KL(final || lens)", "95% interval", "names"))

