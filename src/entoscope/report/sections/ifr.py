"""The report's information-flow-routes section: the routes of a few IOI prompts (Ferrando & Voita 2024)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ...registry import register
from ...results.page import figure_div, table_html
from ..preflight import runs_by
from ..section import Section, lead_of, run_saved


def ifr_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...circuits import InformationFlowRoutes

    return [(InformationFlowRoutes(drawn_routes=1 if quick else 2), {"task": "ioi", "n": 4 if quick else 16, "seed": 3})]


@register("report_section", "ifr")
@runs_by(ifr_runs)
def ifr_section(model: Any, folder: Path, quick: bool) -> Section:
    """Run IFR on IOI prompts of `model`, save the Result under `folder`, return the Section."""
    [(op, data)] = ifr_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    figs = "".join(f'<p class="figtitle">{html.escape(title)}</p>' + figure_div(fig) for title, fig in result.figures())
    note = (f'<p class="note">An edge is kept when its proximity share of its node is above tau = {op.tau:g}; '
            "routes start at the last position, last layer. Every prompt's graph is saved as GraphML and JSON "
            "under <code>ifr/graphs/</code>.</p>")
    lead = lead_of(result, folder, folder.parent) or \
        "Information flow routes of IOI prompts: the components each prompt's prediction is built from."
    t = result.table
    if "moved_importance_mean" in t:  # the routes into the prediction first, as the lead names them
        t = t.sort_values(["moved_importance_mean", "importance_mean"], ascending=False, kind="stable")
    caption = ('<p class="figtitle">components by the importance of their routes into the prediction from earlier '
               f'tokens (every component: <a href="{folder.name}/table.csv">table.csv</a>)</p>')
    return Section("information flow routes on IOI", lead, note + figs + caption + table_html(t, max_rows=12),
                   terms=("information flow routes", "names"))
