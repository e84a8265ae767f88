"""Small offline HTML pages: plotly figures that share one plotly.min.js per run folder.

A page at `runs/x/index.html` loads `../plotly.min.js`, written once into the run folder `runs/`
from the copy inside the plotly package, so pages stay a few hundred kB and open without a network.
"""

from __future__ import annotations

import html
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pandas as pd

PLOTLY_JS = "plotly.min.js"


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
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def table_html(frame: pd.DataFrame, max_rows: int = 200) -> str:
    shown = frame.head(max_rows)
    note = "" if len(frame) <= max_rows else f"<p>first {max_rows} of {len(frame)} rows; all rows in table.csv</p>"
    return note + shown.to_html(index=False, float_format=lambda x: f"{x:.4g}", classes="table", border=0)


def warnings_html(warned: list[dict[str, str]]) -> str:
    """The run's recorded warnings, shown above everything else on its page."""
    if not warned:
        return ""
    items = "".join(f"<li><code>{html.escape(w['code'])}</code> {html.escape(w['message'])}</li>" for w in warned)
    return f'<div class="warnings"><strong>warnings</strong><ul>{items}</ul></div>'


def write_page(path: Path, title: str, sections: list[tuple[str, str]], js_relpath: str = PLOTLY_JS,
               summary: dict[str, Any] | None = None, warned: list[dict[str, str]] | None = None) -> Path:
    """An HTML page of titled sections (raw HTML bodies); plotly loaded from `js_relpath`."""
    parts = [f"<h2>{html.escape(h)}</h2>\n{body}" for h, body in sections]
    meta = warnings_html(warned or [])
    if summary:
        meta += "<details><summary>run details</summary><pre>" + html.escape(json.dumps(summary, indent=2)) + \
            "</pre></details>"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<script src="{js_relpath}"></script>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table.table {{ border-collapse: collapse; font-size: 0.85em; }}
table.table td, table.table th {{ padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
.warnings {{ background: #fff4e5; border-left: 4px solid #e69500; padding: 0.5em 1em; margin: 1em 0; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
{meta}
{''.join(parts)}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
