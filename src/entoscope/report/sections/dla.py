"""The report's direct-logit-attribution section: DLA of the IOI logit difference (IO minus S)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ...results.page import figure_div, table_html
from ..preflight import runs_by
from ..section import Section, lead_of, run_saved
from ..sizes import sizes


COLUMNS = ["component", "kind", "mean", "mean_ci_low", "mean_ci_high", "mean_q", "significant", "n_prompts"]


def dla_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...circuits import DirectLogitAttribution

    data = {"task": "ioi", "n": sizes(model, "dla", quick)["n"], "seed": 7}  # prompts: report/sizes.py
    return [(DirectLogitAttribution(metric="logit_diff"), data)]


@register("report_section", "dla")
@runs_by(dla_runs)
def dla_section(model: Any, folder: Path, quick: bool) -> Section:
    """Run DLA on IOI prompts of `model`, save the Result under `folder`, return the Section."""
    [(op, data)] = dla_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    t = result.table
    top = t.reindex(t["mean"].abs().sort_values(ascending=False).index)
    identity = result.extra["identity"]
    note = (f'<p class="note">Checked per prompt: the rows plus the constant reproduce the model\'s logit difference '
            f"within {identity['error'].max():.2g} (allowed {identity['allowed'].min():.2g} or more).</p>")
    figs = "".join(figure_div(fig) for _, fig in result.figures())
    shown = top[[c for c in COLUMNS if c in top]]
    return Section("direct logit attribution on IOI (logit difference: IO minus S)",
                   lead_of(result, folder, folder.parent),
                   note + figs + table_html(shown, max_rows=12, note=result.blank_note),
                   terms=("direct logit attribution", "logit difference", "95% interval", "q-value", "names"))

