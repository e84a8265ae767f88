"""The report's information-flow-routes section: the routes of a few IOI prompts (Ferrando & Voita 2024)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

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
    return Section("information flow routes on IOI", lead, note + figs + caption + table_html(t, max_rows=12)
                   + sources_html(result), terms=("information flow routes", "names"))


def sources_html(result: Any, top: int = 8) -> str:
    """Where each of the strongest routes into the prediction comes from: per component, the earlier tokens its
    kept attention edges into the last position read, prompt by prompt (from the per-prompt edge table), so a
    reader sees which heads move which word (on IOI: the indirect object's name, the subject's, the verb)."""
    edges = result.per_prompt.to_pandas() if hasattr(result.per_prompt, "to_pandas") else result.per_prompt
    if edges is None or not len(edges):
        return ""
    last = edges.groupby("example")["target_position"].transform("max")
    moved = edges[(edges["kind"] == "attention") & (edges["target_position"] == last)
                  & (edges["source_position"] < last)].assign(back=lambda e: last[e.index] - e["source_position"])
    if not len(moved):
        return ""
    rows = []
    for comp, sub in moved.groupby("component"):
        by_prompt = sub.sort_values("importance", ascending=False).drop_duplicates("example").sort_values("example")
        rows.append({"component": comp, "summed importance": float(sub["importance"].sum()),
                     "prompts": int(sub["example"].nunique()),
                     "tokens back (mean)": float(by_prompt["back"].mean()),
                     "source token, prompt by prompt": ", ".join(by_prompt["source_token"].astype(str).str.strip())})
    frame = pd.DataFrame(rows).sort_values("summed importance", ascending=False, kind="stable").head(top)
    return ('<p class="figtitle">what the strongest routes into the prediction read: each head\'s source token with '
            'the largest importance, prompt by prompt (its per-prompt edges: per_prompt.csv)</p>'
            + table_html(frame.reset_index(drop=True), max_rows=top))
