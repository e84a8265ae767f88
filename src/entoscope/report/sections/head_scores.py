"""The report's head-scores section: every kind (previous-token, duplicate-token, induction) side by side."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ...models.adapter import adapt
from ...registry import register
from ...results.page import figure_div, table_html
from ..preflight import runs_by
from ..section import Section, lead_of, run_saved
from ..sizes import sizes


def head_scores_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...circuits import HeadScores

    data = {"task": "repeated_tokens", "n": sizes(model, "head_scores", quick)["n"], "seed": 3,
            "params": {"length": 20, "bos_token_id": adapt(model).bos_token_id}}
    return [(HeadScores(period=20), data)]


@register("report_section", "head_scores")
@runs_by(head_scores_runs)
def head_scores_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...circuits.head_figures import head_score_panels

    [(op, data)] = head_scores_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    t = result.table
    passing = t[t["passes"].astype(bool)] if "passes" in t else t.iloc[:0]
    key = t["over_control"].fillna(t["score"]) if "over_control" in t else t["score"]
    shown = (passing.assign(_key=key).sort_values(["kind", "_key"], ascending=[True, False], kind="stable")
             .drop(columns="_key").head(24) if len(passing) else t.sort_values("score", ascending=False).head(12))
    what = ("the heads that pass their kind's test" if len(passing) else
            "no head passes its kind's test: the highest scores")
    body = (figure_div(head_score_panels(t)) + f'<p class="figtitle">{html.escape(what)} (the whole table: '
            f'<a href="{folder.name}/table.csv">table.csv</a>)</p>' + table_html(shown, note=result.blank_note))
    return Section("attention head scores on repeated random tokens", lead_of(result, folder, folder.parent), body,
                   terms=("score", "score_tl", "head tests", "names"))
