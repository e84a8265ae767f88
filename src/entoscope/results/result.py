"""`Result`: what every operation returns — a tidy table, figures, and `save(dir)`."""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from .claims import write_takeaways
from .folder import writing_run
from .lazy import LazyTable
from .page import ensure_plotly_js, figure_div, table_html, write_page


class Result:
    """The outcome of one run.

    table:      tidy DataFrame, one row per site (and per prompt where the operation was asked to).
    per_prompt: optional DataFrame of per-prompt values (for drill-down), or None. An operation may
                hand a LazyTable (results/lazy.py): its rows are made when first read, and `save`
                writes them block by block without ever holding them all.
    manifest:   config, model identity, data, versions, seed and timings (set by Operation.run).
    extra:      named tensors or objects an operation keeps for Python users (not saved as tables).
    takeaway:   a sentence or two computed from the numbers: what the result shows (page lead, notebook).
    blank_note: what a blank (NaN) cell of the table means for this operation.
    tables:     further named tidy tables of the run (`es.inspect`: the lens grid, attention, DLA, ...), each
                saved as NAME.csv and NAME.parquet beside table.csv, listed in the manifest's `tables` and
                read back by `Result.load`.
    """

    def __init__(self, operation: str, table: pd.DataFrame, *, per_prompt: pd.DataFrame | None = None,
                 figures: Callable[[Result], list[tuple[str, Any]]] | None = None, title: str | None = None,
                 extra: dict[str, Any] | None = None, takeaway: str | Callable[[Result], str] = "",
                 blank_note: str = "") -> None:
        self.operation = operation
        self.table = table
        self.per_prompt = per_prompt  # type: ignore[assignment]
        self.manifest: dict[str, Any] = {}
        self.plan: Any = None
        self.js_relpath = "plotly.min.js"
        self.back_relpath: str | None = None
        self.warnings: list[dict[str, str]] = []  # recorded warnings of the run (also in the manifest)
        self.page_warnings: list[dict[str, str]] = []  # what the numbers themselves caution (degenerate pairs)
        self.extra = extra or {}
        self.title = title or operation
        self._figures = figures
        self._takeaway = takeaway
        self.blank_note = blank_note
        self.shards_dir: Path | None = None  # a sharded run's shard folder (set by Operation.run)
        self.notes: list[tuple[str, str]] = []  # (title, text) sections on how to read the page, before the table
        self.confirmation: pd.DataFrame | None = None  # the top cells re-tested on fresh prompts (confirm.py)
        self.tables: dict[str, pd.DataFrame] = {}  # further named tables (saved as NAME.csv / NAME.parquet)
        # those of them shown on the page, each after the note of the same title: (title, table name)
        self.shown_tables: list[tuple[str, str]] = []

    @property
    def per_prompt(self) -> pd.DataFrame | None:
        if isinstance(self._per_prompt, LazyTable):
            self._per_prompt = self._per_prompt.to_pandas()
        return self._per_prompt

    @per_prompt.setter
    def per_prompt(self, value: pd.DataFrame | LazyTable | None) -> None:
        self._per_prompt = value

    def per_prompt_blocks(self) -> Iterator[pd.DataFrame]:
        """The per-prompt table in blocks of whole prompts, in prompt order, never built whole."""
        pp = self._per_prompt
        if isinstance(pp, LazyTable):
            yield from pp.blocks()
        elif pp is not None:
            yield pp

    def per_prompt_head(self, prompts: int) -> pd.DataFrame | None:
        """The per-prompt rows of the first `prompts` prompts (what a page shows), made without the rest."""
        pp = self._per_prompt
        if pp is None:
            return None
        if isinstance(pp, LazyTable):
            return pp.head(prompts)
        if "example" not in pp:
            return pp
        return pp[pp["example"].isin(pd.unique(pp["example"])[:prompts])]

    def __repr__(self) -> str:
        return f"<Result {self.operation}: {len(self.table)} rows; columns {list(self.table.columns)}>"

    @property
    def takeaway(self) -> str:
        """What the result shows, computed from its numbers ('' if none): a `Takeaway` (results/claims.py) whose
        `lead` says in a sentence or two what held and whose `details` give the figures and caveats; the
        whole text is what a notebook and `print` show."""
        t = self._takeaway
        return t(self) if callable(t) else t

    def _repr_html_(self) -> str:
        """A notebook shows the takeaway, the main figure and the head of the table, offline: plotly.js goes
        into the first output of the kernel that draws a figure (results/notebook.py)."""
        from .notebook import plotly_once

        figs = self.figures()
        parts = [f"<h4>{html.escape(self.title)}</h4>"]
        if self.takeaway:
            parts.append(f"<p>{html.escape(self.takeaway)}</p>")
        if figs:
            parts.append(plotly_once() + figure_div(figs[0][1]))
        parts.append(table_html(self.table, max_rows=10, note=self.blank_note))
        return "".join(parts)

    def figures(self) -> list[tuple[str, Any]]:
        """(title, plotly figure) pairs for the page."""
        return self._figures(self) if self._figures else []

    def figure(self) -> Any:
        """The main plotly figure."""
        figs = self.figures()
        if not figs:
            raise ValueError(f"{self.operation} has no figure")
        return figs[0][1]

    def save(self, folder: str | Path, *, overwrite: bool = False, assets_dir: str | Path | None = None) -> Path:
        """Write table.csv, table.parquet (+ per_prompt.*), index.html and manifest.json into `folder`.

        The folder is self-contained (its own plotly.min.js) and written atomically: into a hidden
        sibling first, renamed into place when complete. An existing run there is replaced only with
        `overwrite=True`. Pages of a report pass the report's folder as `assets_dir` to share one
        plotly.min.js.
        """
        final = Path(folder)
        keep = self.shards_dir is not None and self.shards_dir.resolve() == (final / "shards").resolve()
        with writing_run(final, overwrite=overwrite, keep_shards=keep) as out:
            self._write(out, final, assets_dir)
        return final

    def _write(self, out: Path, final: Path, assets_dir: str | Path | None) -> None:
        from .manifest import FORMAT_VERSION

        files = []
        json_columns: dict[str, list[str]] = {}
        for name, frame in (("table", self.table), ("per_prompt", self._per_prompt)):
            if frame is None:
                continue
            encoded: set[str] = set()

            def safe(f: pd.DataFrame, encoded: set[str] = encoded) -> pd.DataFrame:
                return _parquet_safe(f, encoded)
            if isinstance(frame, LazyTable):
                files += frame.write(out, name, safe)
            else:
                frame.to_csv(out / f"{name}.csv", index=False)
                safe(frame).to_parquet(out / f"{name}.parquet", index=False)
                files += [f"{name}.csv", f"{name}.parquet"]
            if encoded:
                json_columns[name] = sorted(encoded)
        assets = Path(assets_dir) if assets_dir is not None else out
        ensure_plotly_js(assets)
        if assets_dir is None:
            files.append("plotly.min.js")
        rel = Path(os.path.relpath((final if assets_dir is None else assets).resolve() / "plotly.min.js",
                                   final.resolve())).as_posix()
        for name, frame in self.tables.items():
            frame.to_csv(out / f"{name}.csv", index=False)
            frame.to_parquet(out / f"{name}.parquet", index=False)
            files += [f"{name}.csv", f"{name}.parquet"]
        sections = self.page_sections()
        if self.confirmation is not None:  # both stages of the top cells (confirm.py)
            self.confirmation.to_csv(out / "confirmation.csv", index=False)
            files.append("confirmation.csv")
            title = "confirmation on fresh prompts"  # one section: its note (operation.py), then its table
            note = "".join(body for t, body in sections if t == title)
            sections = [(t, body) for t, body in sections if t != title]
            sections.insert(len(sections) - 1, (title, note + table_html(self.confirmation)))
        for title, name in self.shown_tables:  # e.g. patching's exact re-check (patching/recheck.py)
            frame = self.tables[name]
            note = "".join(body for t, body in sections if t == title)
            sections = [(t, body) for t, body in sections if t != title]
            sections.insert(len(sections) - 1, (title, note + table_html(frame)))
        summary = {k: self.manifest.get(k) for k in ("operation", "config", "timings", "created")} \
            if self.manifest else None
        self.js_relpath = rel  # for pages save_extra writes beside index.html
        back = None
        if assets_dir is not None and (Path(assets_dir) / "index.html").resolve() != (final / "index.html").resolve():
            back = Path(os.path.relpath(Path(assets_dir).resolve() / "index.html", final.resolve())).as_posix()
        self.back_relpath = back  # for pages save_extra writes beside index.html
        lead = self.takeaway
        write_page(out / "index.html", self.title, sections, js_relpath=rel, summary=summary,
                   warned=self.warnings + self.page_warnings,
                   lead=lead, back=back)
        files.append("index.html")
        if lead:  # the takeaway's claims: each number's table cell, each qualifier's rule (results/claims.py)
            write_takeaways(out / "takeaway.json", [("index.html", lead)])
            files.append("takeaway.json")
        self.save_extra(out, files)
        shard_files = [f"shards/{f}" for f in self.manifest.get("executor", {}).get("shard_files", [])] \
            if self.shards_dir is not None and self.shards_dir.resolve() == (final / "shards").resolve() else []
        manifest = {"format_version": FORMAT_VERSION, "operation": self.operation, **self.manifest,
                    "title": self.title, "takeaway": self.takeaway,
                    "takeaway_lead_end": getattr(lead, "lead_end", None), "blank_note": self.blank_note,
                    "json_columns": json_columns, "tables": sorted(self.tables),
                    "files": files + shard_files + ["manifest.json"]}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str), encoding="utf-8")

    def page_sections(self) -> list[tuple[str, str]]:
        """The page's (title, HTML) sections: each figure, the notes on how to read the page, then the table
        (a result that draws its own view overrides this: `es.inspect`)."""
        sections = [(t, figure_div(f)) for t, f in self.figures()]
        sections += [(t, f'<p class="note">{html.escape(text)}</p>') for t, text in self.notes]
        sections.append(("table", table_html(self.table, note=self.blank_note)))
        return sections

    def save_extra(self, folder: Path, files: list[str]) -> None:
        """Hook for operations that save more (directions, translators, graphs); append file names."""

    @classmethod
    def load(cls, folder: str | Path) -> Result:
        """A saved run folder (or a report's section folder) opened again: its table, per-prompt table (read
        when first asked for), takeaway, title, warnings and manifest. Figures are not rebuilt: the folder's
        index.html has them. A folder that is not a complete run is refused, naming the file
        (`not_a_run`, `manifest_invalid`, `run_file_missing`: docs/errors.md)."""
        from .saved import load_run

        return load_run(folder)


def _parquet_safe(frame: pd.DataFrame, encoded: set[str] | None = None) -> pd.DataFrame:
    """Parquet needs one type per column: lists/dicts/mixed objects are written as JSON strings (their
    names added to `encoded`, which the manifest keeps so that `Result.load` decodes them)."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype == object:
            kinds = {type(v) for v in out[col] if v is not None}
            if kinds and not kinds <= {str}:
                out[col] = out[col].map(lambda v: v if v is None else json.dumps(v, default=str))
                if encoded is not None:
                    encoded.add(str(col))
    return out
