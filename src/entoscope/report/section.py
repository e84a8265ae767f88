"""One way of building a report section: run operations, save each Result in the section's folder, and
return a `Section` (title, the takeaway computed from the numbers, the body, one link, the terms it uses).

A section function is registered with `register("report_section", name)` and called as
`fn(model, folder, quick) -> Section`; its first Result is saved in `folder` (the section's own page),
further ones below it, all sharing the report's plotly.min.js.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..results.claims import Takeaway
from ..results.page import figure_div, lead_html, table_html
from .glossary import TERMS


@dataclass
class Section:
    title: str
    lead: str  # what the section shows and what to conclude, computed from its numbers
    body: str  # HTML
    terms: tuple[str, ...] = ()  # glossary terms the section uses (defined beside it)
    own_page: bool = True  # False where the body links each of its results' pages itself (examples_html)

    def __post_init__(self) -> None:
        unknown = [t for t in self.terms if t not in TERMS]
        if unknown:
            raise KeyError(f"terms without a definition in report/glossary.py: {unknown}")


def lead_of(result: Any, where: Path, root: Path) -> str:
    """A Result's takeaway as a section's lead: its claims' sources made relative to the report's root."""
    t = result.takeaway
    rel = Path(where).resolve().relative_to(Path(root).resolve()).as_posix()
    return t.rebased(rel) if isinstance(t, Takeaway) and rel != "." else t


def run_saved(operation: Any, model: Any, data: Any, where: Path, root: Path) -> Any:
    """operation.run(model, data), saved in `where` with the report's shared assets in `root`."""
    result = operation.run(model, data, quiet=True)
    result.save(where, assets_dir=root)
    return result


def result_html(result: Any, *, max_rows: int = 12, figures: int = 1, lead: bool = True,
                columns: list[str] | None = None) -> str:
    """A Result in a section: its takeaway (its lead, the details below it), its first `figures` figures (titled)
    and the head of its table (only `columns`, where given: the page of the result has them all)."""
    parts = [lead_html(result.takeaway, "takeaway")] if lead and result.takeaway else []
    for title, fig in result.figures()[:figures]:
        titled = bool(fig.layout.title and fig.layout.title.text)  # the figure names itself
        parts.append(("" if titled else f'<p class="figtitle">{html.escape(title)}</p>') + figure_div(fig))
    table = result.table if columns is None else result.table[[c for c in columns if c in result.table]]
    parts.append(table_html(table, max_rows=max_rows, note=result.blank_note))
    return "".join(parts)


def examples_html(operation: Any, model: Any, examples: list[tuple[str, dict[str, Any], Any]], folder: Path, *,
                  max_rows: int, columns: list[str] | None = None) -> tuple[str, list[Any]]:
    """Run each (title, config, data) as `operation(**config)`: the first Result is saved in `folder`, the
    others in folder/example<i>, each shown with its takeaway and a link to its own page.
    Returns (html, results)."""
    parts, results = [], []
    for i, (title, config, data) in enumerate(examples):
        where = Path(folder) if i == 0 else Path(folder) / f"example{i}"
        result = operation(**config).run(model, data, quiet=True)
        result.save(where, assets_dir=Path(folder).parent)
        results.append(result)
        rel = f"{Path(folder).name}/index.html" if i == 0 else f"{Path(folder).name}/{where.name}/index.html"
        link = f'<p class="more"><a href="{rel}">{html.escape(title)}: every figure and the whole table</a></p>'
        parts.append(f"<h3>{html.escape(title)}</h3>" + result_html(result, max_rows=max_rows, columns=columns) + link)
    return "".join(parts), results
