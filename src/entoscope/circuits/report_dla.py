"""The report's direct-logit-attribution section: DLA of the IOI logit difference (IO minus S)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..registry import register
from ..results.page import figure_div, table_html


@register("report_section", "dla")
def dla_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    """Run DLA on IOI prompts of `model`, save the Result under `folder`, return (title, html)."""
    from .dla import DirectLogitAttribution

    data = {"task": "ioi", "n": 8 if quick else 32, "seed": 7}
    result = DirectLogitAttribution(metric="logit_diff").run(model, data, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    identity = result.extra["identity"]
    figs = "".join(figure_div(fig) for _, fig in result.figures())
    top = result.table.reindex(result.table["mean"].abs().sort_values(ascending=False).index)
    note = (f"<p>{len(identity)} prompts; rows + constant reproduce the model's logit difference within "
            f"{identity['error'].max():.2g} (allowed {identity['allowed'].min():.2g} or more).</p>")
    return ("direct logit attribution on IOI (logit difference: IO minus S)",
            note + figs + table_html(top, max_rows=12))
