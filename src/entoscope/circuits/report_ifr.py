"""The report's information-flow-routes section: the routes of a few IOI prompts (Ferrando & Voita 2024)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..registry import register
from ..results.page import figure_div, table_html


@register("report_section", "ifr")
def ifr_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    """Run IFR on IOI prompts of `model`, save the Result under `folder`, return (title, html)."""
    from .ifr import InformationFlowRoutes

    op = InformationFlowRoutes(drawn_routes=1 if quick else 2)
    result = op.run(model, {"task": "ioi", "n": 4 if quick else 16, "seed": 3}, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    figs = "".join(figure_div(fig) for _, fig in result.figures())
    note = (f"<p>{len(result.extra['graphs'])} prompts; an edge is kept when its proximity share of its "
            f"node is above tau = {op.tau:g}; routes start at the last position, last layer. Every "
            "prompt's graph is saved as GraphML and JSON under <code>ifr/graphs/</code>.</p>")
    return ("information flow routes on IOI", note + figs + table_html(result.table, max_rows=12))
