"""`entoscope report`: one offline page about a model — its structure, how it does the built-in
tasks, and a section per operation (each registered with `register("report_section", name)`:
a function (model, folder, quick) -> (title, html) that saves its own Result under folder)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .evaluate import format_scores, task_scores
from .models.adapter import adapt
from .registry import lookup, names, register
from .results.folder import writing_run
from .results.page import ensure_plotly_js, figure_div, table_html, write_page

SECTION_ORDER = ["lens", "head_scores", "dla", "patching", "probing", "circuits", "ifr"]


def build_report(model: Any, out: str | Path, *, quick: bool = False, sections: list[str] | None = None,
                 overwrite: bool = False) -> Path:
    """Write `out/index.html` (and one sub-folder per section). Returns the page path.

    The report is built in a hidden sibling folder and renamed into place when complete, so an
    interrupted report never leaves pages of two reports together; an existing report is replaced
    only with `overwrite=True`.
    """
    a = adapt(model)
    final = Path(out)
    with writing_run(final, overwrite=overwrite) as folder, a.evaluating():
        _write_report(model, a, folder, quick, sections)
    return final / "index.html"


def _write_report(model: Any, a: Any, folder: Path, quick: bool, sections: list[str] | None) -> None:
    from .results.manifest import model_identity, package_versions

    ensure_plotly_js(folder)
    scores = task_scores(model, n=32 if quick else 128)
    parts: list[tuple[str, str]] = [
        ("model", f"<pre>{html.escape(a.structure.describe())}</pre>"),
        ("built-in tasks", f"<pre>{html.escape(format_scores(scores))}</pre>"),
    ]
    chosen = sections if sections is not None else [s for s in SECTION_ORDER if s in names("report_section")]
    chosen += [s for s in names("report_section") if s not in chosen and sections is None]
    for name in chosen:
        title, body = lookup("report_section", name)(model, folder / name, quick)
        parts.append((title, body + f'<p><a href="{name}/index.html">full results: {name}/</a></p>'))
    (folder / "scores.json").write_text(json.dumps(scores, indent=2))
    manifest = {"operation": "report", "quick": quick, "sections": chosen, "model": model_identity(a),
                "versions": package_versions()}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str), encoding="utf-8")
    write_page(folder / "index.html", f"entoscope report: {a.name}", parts, js_relpath="plotly.min.js")


def section_html(result: Any, max_rows: int = 12) -> str:
    figs = result.figures()
    body = figure_div(figs[0][1]) if figs else ""
    return body + table_html(result.table, max_rows=max_rows)


def examples_html(operation: Any, model: Any, examples: list[tuple[str, Any, Any]], folder: Path, *,
                  max_rows: int, note: Any = None) -> str:
    """Run each (title, config, data) example as `operation(**config).run(model, data)`; the first Result is
    saved in `folder`, the others in folder/example<i> with a link from the report page (one folder up).
    `note(result) -> str`: a sentence computed from the numbers, shown above the example's figure."""
    parts = []
    for i, (title, config, data) in enumerate(examples):
        result = operation(**config).run(model, data, quiet=True)
        where = Path(folder) if i == 0 else Path(folder) / f"example{i}"
        result.save(where, assets_dir=Path(folder).parent)
        link = "" if i == 0 else f'<p><a href="{Path(folder).name}/{where.name}/index.html">full results</a></p>'
        text = f"<p>{html.escape(note(result))}</p>" if note is not None else ""
        parts.append(f"<h3>{title}</h3>" + text + section_html(result, max_rows=max_rows) + link)
    return "".join(parts)


@register("report_section", "lens")
def _lens_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    from .lens import Lens
    from .sites import Sites

    op = Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions="-8:"))
    result = op.run(model, {"task": "ioi", "n": 8 if quick else 32, "seed": 7}, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    return ("logit lens on IOI (last 8 positions)", section_html(result))


@register("report_section", "head_scores")
def _head_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    from .circuits import HeadScores

    a = adapt(model)
    data = {"task": "repeated_tokens", "n": 8 if quick else 32, "seed": 3,
            "params": {"length": 20, "bos_token_id": a.bos_token_id}}
    result = HeadScores(period=20).run(model, data, quiet=True)
    result.save(folder, assets_dir=folder.parent)
    return ("attention head scores on repeated random tokens (period 20)", section_html(result))
