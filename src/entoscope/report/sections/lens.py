"""The report's lens section: the logit lens on IOI prompts, by layer, at the last positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ..preflight import runs_by
from ..section import Section, lead_of, result_html, run_saved


def lens_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...lens import Lens
    from ...sites import Sites

    op = Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions="-8:"))
    return [(op, {"task": "ioi", "n": 8 if quick else 32, "seed": 7})]


@register("report_section", "lens")
@runs_by(lens_runs)
def lens_section(model: Any, folder: Path, quick: bool) -> Section:
    [(op, data)] = lens_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    return Section("logit lens on IOI (last 8 positions)", lead_of(result, folder, folder.parent),
                   result_html(result, lead=False),
                   terms=("logit lens", "KL(final || lens)", "95% interval", "names"))

