"""The report's direct-logit-attribution section: DLA of the IOI logit difference (IO minus S)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ...results.page import figure_div, table_html
from ..section import Section, run_saved


@register("report_section", "dla")
def dla_section(model: Any, folder: Path, quick: bool) -> Section:
    """Run DLA on IOI prompts of `model`, save the Result under `folder`, return the Section."""
    from ...circuits import DirectLogitAttribution

    data = {"task": "ioi", "n": 8 if quick else 32, "seed": 7}
    result = run_saved(DirectLogitAttribution(metric="logit_diff"), model, data, folder, folder.parent)
    identity = result.extra["identity"]
    t = result.table
    top = t.reindex(t["mean"].abs().sort_values(ascending=False).index)
    lead = result.takeaway or _lead(top, identity)
    figs = "".join(figure_div(fig) for _, fig in result.figures())
    return Section("direct logit attribution on IOI (logit difference: IO minus S)", lead,
                   figs + table_html(top, max_rows=12, note=result.blank_note),
                   terms=("direct logit attribution", "logit difference", "95% interval"))


def _lead(top: Any, identity: Any) -> str:
    rows = top[top["kind"] != "constant"].head(3) if "kind" in top else top.head(3)
    cells = "; ".join(f"{r.component} {r.mean:+.2f}" for r in rows.itertuples())
    return (f"The components writing most directly to the logit difference, mean over {len(identity)} prompts: "
            f"{cells}. The rows plus the constant reproduce the model's logit difference within "
            f"{identity['error'].max():.2g}.")
