"""Small offline HTML pages: titled sections of text, plotly figures and tables.

A run folder is self-contained: its page loads the plotly.min.js beside it (a report's pages share
the report's copy). Every page has a table of contents when it has several sections and, below a
report, a link back to the summary. Tables scroll inside their own box (a page never grows wider
than the window), blank cells are explained under the table instead of showing `<NA>`, and columns
with no value at all are listed rather than shown.
"""

from __future__ import annotations

import html
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

PLOTLY_JS = "plotly.min.js"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 1.5em 2em; max-width: 1150px; color: #222;
       line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
nav.top { font-size: 0.9em; margin-bottom: 1em; } nav.toc { background: #f7f7f7; padding: 0.6em 1em; }
nav.toc ol { margin: 0.3em 0; padding-left: 1.4em; columns: 2; }
.lead { font-size: 1.05em; background: #f2f7fd; border-left: 4px solid #2b6cb0; padding: 0.6em 1em; }
.table-wrap { overflow-x: auto; max-width: 100%; margin: 0.5em 0; }
table.table { border-collapse: collapse; font-size: 0.82em; white-space: nowrap; }
table.table td, table.table th { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }
table.table th { background: #fafafa; position: sticky; top: 0; } table.table td.t { text-align: left; }
p.note { font-size: 0.85em; color: #555; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
.warnings { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.5em 1em; margin: 1em 0; }
.plotly-graph-div { max-width: 100%; }
p.takeaway { font-size: 1.02em; background: #f2f7fd; border-left: 4px solid #2b6cb0; padding: 0.5em 0.9em; }
p.details { font-size: 0.9em; color: #333; margin: -0.4em 0 1em; padding: 0 0 0 1.25em; }
p.figtitle { font-weight: 600; margin: 1.2em 0 0.2em; } p.more { margin: 0.4em 0 1.2em; }
details.terms { font-size: 0.88em; margin: 0.5em 0; } details.terms dt { font-weight: 600; margin-top: 0.3em; }
details.terms dd { margin-left: 1.2em; } ul.glance li { margin: 0.35em 0; }
"""


def ensure_plotly_js(folder: Path) -> Path:
    """Write plotly.min.js into `folder` once (from the installed plotly package)."""
    from plotly.offline import get_plotlyjs

    target = folder / PLOTLY_JS
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{PLOTLY_JS}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # one per writer: no clash
        try:
            tmp.write_text(get_plotlyjs(), encoding="utf-8")
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def figure_div(fig: Any) -> str:
    """A figure that fills its column's width, sized and labelled by the house rules (results/figures.py)."""
    from .figures import polish

    margin = fig.layout.margin
    fig.update_layout(autosize=True, width=None, margin={"l": margin.l or 60, "r": margin.r or 30,
                                                         "t": margin.t or 50, "b": margin.b or 60})
    polish(fig)
    return fig.to_html(full_html=False, include_plotlyjs=False,
                       config={"displaylogo": False, "responsive": True})


def _cell(v: Any) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        return f"{v:.4g}"
    return html.escape(str(v))


def table_html(frame: pd.DataFrame, max_rows: int = 200, note: str = "") -> str:
    """The first rows of a table in a scrolling box. Columns with no value at all are named below it,
    blank cells are explained (`note` says what a blank means for this table). p-values read as text,
    "< 0.0095" where the resamples resolve no smaller one (stats.readable_p)."""
    from ..stats.columns import readable_p

    frame = readable_p(frame)
    empty = [c for c in frame.columns if frame[c].isna().all()]
    shown = frame.drop(columns=empty).head(max_rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    body = "".join("<tr>" + "".join(f'<td class="t">{_cell(v)}</td>' if isinstance(v, str) else f"<td>{_cell(v)}</td>"
                                    for v in row) + "</tr>"
                   for row in shown.itertuples(index=False, name=None))
    parts = [f'<div class="table-wrap"><table class="table"><thead><tr>{head}</tr></thead>'
             f"<tbody>{body}</tbody></table></div>"]
    notes = []
    if len(frame) > max_rows:
        notes.append(f"first {max_rows} of {len(frame)} rows; all rows in table.csv")
    if empty:
        notes.append(f"no value in this run (not shown): {', '.join(map(str, empty))}")
    if shown.isna().any().any():
        notes.append("a blank cell has no value" + (f": {note}" if note else ""))
    if notes:
        parts.append(f'<p class="note">{html.escape("; ".join(notes))}.</p>')
    return "".join(parts)


def warnings_html(warned: list[dict[str, str]]) -> str:
    """The run's warnings (recorded ones, and what its numbers caution), each with its count where it was said
    more than once, shown in one box above everything else on its page."""
    if not warned:
        return ""
    def item(w: dict[str, Any]) -> str:
        count = int(w.get("count", 1) or 1)
        said = f" ({count} times)" if count > 1 else ""
        return f"<li><code>{html.escape(str(w['code']))}</code> {html.escape(str(w['message']))}{said}</li>"
    title = "warning" if len(warned) == 1 else f"{len(warned)} warnings"
    return f'<div class="warnings"><strong>{title}</strong><ul>{"".join(item(w) for w in warned)}</ul></div>'


def lead_html(takeaway: str, cls: str = "lead") -> str:
    """A takeaway on a page: its lead in the lead box (`cls`: lead on a run page, takeaway in a section), its
    details (figures and caveats, results/claims.py `split_lead`) in a paragraph just below it."""
    from .claims import split_lead

    lead, details = split_lead(takeaway)
    if not lead:
        return ""
    out = f'<p class="{cls}">{html.escape(lead)}</p>'
    return out + (f'<p class="details">{html.escape(details)}</p>' if details else "")


def anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60] or "section"


def write_page(path: Path, title: str, sections: list[tuple[str, str]], js_relpath: str = PLOTLY_JS,
               summary: dict[str, Any] | None = None, warned: list[dict[str, str]] | None = None,
               lead: str = "", back: str | None = None) -> Path:
    """An HTML page of titled sections (raw HTML bodies); plotly loaded from `js_relpath`.

    lead: a sentence or two at the top saying what the page shows and what to conclude; a `Takeaway` with a
          lead mark shows its lead there and its details just below (`lead_html`).
    back: a relative link to the summary page above this one (a report's index.html).
    """
    ids: list[str] = []
    parts = []
    for h, body in sections:
        a = anchor(h)
        while a in ids:
            a += "-x"
        ids.append(a)
        parts.append(f'<h2 id="{a}">{html.escape(h)}</h2>\n{body}')
    nav = f'<nav class="top"><a href="{html.escape(back)}">&larr; back to the summary</a></nav>' if back else ""
    toc = ""
    if len(sections) > 2:
        items = "".join(f'<li><a href="#{a}">{html.escape(h)}</a></li>' for (h, _), a in zip(sections, ids))
        toc = f'<nav class="toc"><strong>contents</strong><ol>{items}</ol></nav>'
    meta = warnings_html(warned or [])
    if summary:
        meta += "<details><summary>run details</summary><pre>" + html.escape(json.dumps(summary, indent=2)) + \
            "</pre></details>"
    lead_part = lead_html(lead) if lead else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<script src="{js_relpath}"></script>
<style>{STYLE}</style></head>
<body>{nav}<h1>{html.escape(title)}</h1>
{lead_part}{meta}{toc}
{''.join(parts)}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
