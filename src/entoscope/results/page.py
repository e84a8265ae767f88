"""Small offline HTML pages: plotly figures that share one plotly.min.js per run folder.

A page at `runs/x/index.html` loads `../plotly.min.js`, written once into the run folder `runs/`
from the copy inside the plotly package, so pages stay a few hundred kB and open without a network.
"""

from __future__ import annotations

import html
import json
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
        tmp = target.with_suffix(".tmp")
        tmp.write_text(get_plotlyjs(), encoding="utf-8")
        tmp.replace(target)
    return target


def figure_div(fig: Any) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def table_html(frame: pd.DataFrame, max_rows: int = 200) -> str:
    shown = frame.head(max_rows)
    note = "" if len(frame) <= max_rows else f"<p>first {max_rows} of {len(frame)} rows; all rows in table.csv</p>"
    return note + shown.to_html(index=False, float_format=lambda x: f"{x:.4g}", classes="table", border=0)


def write_page(path: Path, title: str, sections: list[tuple[str, str]], js_relpath: str = f"../{PLOTLY_JS}",
               summary: dict[str, Any] | None = None) -> Path:
    """An HTML page of titled sections (raw HTML bodies); plotly loaded from `js_relpath`."""
    parts = [f"<h2>{html.escape(h)}</h2>\n{body}" for h, body in sections]
    meta = ""
    if summary:
        meta = "<details><summary>run details</summary><pre>" + html.escape(json.dumps(summary, indent=2)) + \
            "</pre></details>"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<script src="{js_relpath}"></script>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table.table {{ border-collapse: collapse; font-size: 0.85em; }}
table.table td, table.table th {{ padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
{meta}
{''.join(parts)}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
