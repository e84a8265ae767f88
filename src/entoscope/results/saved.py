"""A saved run folder opened again: `Result.load(folder)` gives back its table, per-prompt table, takeaway,
title, warnings and manifest (also for each section folder of a report).

What a folder must hold is what `Result.save` writes: manifest.json with `format_version`, `operation`,
`files` and `takeaway`, and the table files it lists (Parquet, which keeps the column types; columns
saved as JSON text because Parquet has no type for them, named in the manifest's `json_columns`, are
decoded again). Anything else is refused before reading a table, naming the file: `not_a_run`,
`manifest_invalid`, `manifest_too_new`, `manifest_is_report`, `run_file_missing` (docs/errors.md).
The per-prompt table is read when first asked for, and `per_prompt_blocks` streams it in whole prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import ConfigError
from .lazy import BLOCK_ROWS, LazyTable

REQUIRED = ("format_version", "operation", "files", "takeaway")
_RESAVE = "re-run it (`entoscope run FOLDER/manifest.json`) to write a complete folder, or restore the files " \
          "entoscope wrote"


def read_run_manifest(folder: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the folder, its manifest), refused unless it is a saved run this entoscope can read."""
    from .manifest import FORMAT_VERSION

    path = Path(folder).expanduser()
    file = path / "manifest.json"
    if not path.is_dir() or not file.is_file():
        what = "does not exist" if not path.exists() else "is not a folder" if not path.is_dir() else \
            "has no manifest.json"
        raise ConfigError(f"{path} {what}, so it is not a saved entoscope run", code="not_a_run",
                          remedy="give the folder a run was saved into (result.save(folder), --out): it holds "
                          "manifest.json, table.parquet and index.html")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{file} cannot be read as JSON ({err})", code="manifest_invalid", remedy=_RESAVE) from None
    if isinstance(manifest, dict) and manifest.get("operation") == "report":
        raise ConfigError(f"{file} is the manifest of a report, not of one run", code="manifest_is_report",
                          remedy=f"load one of its sections, e.g. Result.load('{path / 'lens'}'), or open "
                          f"{path / 'index.html'}")
    missing = [k for k in REQUIRED if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ConfigError(f"{file} lacks {', '.join(missing)} (written by an older entoscope, or edited by hand)",
                          code="manifest_invalid", remedy=_RESAVE)
    version = manifest["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(f"{file} has manifest format {version!r}; this entoscope reads up to {FORMAT_VERSION}",
                          code="manifest_too_new", remedy="upgrade entoscope to read it")
    if not isinstance(manifest["files"], list) or "table.parquet" not in manifest["files"]:
        raise ConfigError(f"{file} lists no table.parquet in its files", code="manifest_invalid", remedy=_RESAVE)
    return path, manifest


def _table_file(folder: Path, name: str) -> Path:
    file = folder / f"{name}.parquet"
    if not file.is_file():
        raise ConfigError(f"{file} is missing, though manifest.json lists it", code="run_file_missing",
                          remedy=_RESAVE)
    return file


def _from_json(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:  # a block written before the column held anything but text
        return value


def _decode(frame: pd.DataFrame, json_columns: list[str]) -> pd.DataFrame:
    for col in json_columns:
        if col in frame:
            frame[col] = frame[col].map(_from_json)
    return frame


def read_table(file: Path, json_columns: list[str]) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(file)
    except Exception as err:  # a damaged file: pyarrow raises its own errors
        raise ConfigError(f"{file} cannot be read as Parquet ({type(err).__name__}: {err})", code="run_file_missing",
                          remedy=_RESAVE) from None
    return _decode(frame, json_columns)


class SavedTable(LazyTable):
    """A saved per_prompt.parquet, read when asked: whole (`to_pandas`), or in blocks of whole prompts."""

    def __init__(self, file: Path, json_columns: list[str]) -> None:
        import pyarrow.parquet as pq

        self.file, self.json_columns = file, json_columns
        try:
            self.rows = pq.ParquetFile(file).metadata.num_rows
        except Exception as err:
            raise ConfigError(f"{file} cannot be read as Parquet ({type(err).__name__}: {err})",
                              code="run_file_missing", remedy=_RESAVE) from None
        super().__init__(self.rows, lambda lo, hi: self.to_pandas().iloc[lo:hi])

    def to_pandas(self) -> pd.DataFrame:
        return read_table(self.file, self.json_columns)

    def blocks(self) -> Iterator[pd.DataFrame]:
        """Blocks of about BLOCK_ROWS rows, never splitting a prompt (rows of one `example` stay together)."""
        import pyarrow.parquet as pq

        carry: pd.DataFrame | None = None
        for batch in pq.ParquetFile(self.file).iter_batches(batch_size=BLOCK_ROWS):
            frame = _decode(batch.to_pandas(), self.json_columns)
            if carry is not None:
                frame = pd.concat([carry, frame], ignore_index=True)
            if "example" not in frame or not len(frame):
                carry = None
                yield frame
                continue
            last = frame["example"].iloc[-1]
            tail = (frame["example"] == last).to_numpy()
            carry = frame[tail].reset_index(drop=True)
            if (~tail).any():
                yield frame[~tail].reset_index(drop=True)
        if carry is not None and len(carry):
            yield carry

    def head(self, prompts: int) -> pd.DataFrame:
        """The rows of the first `prompts` prompts, read block by block up to them."""
        parts: list[pd.DataFrame] = []
        for block in self.blocks():
            parts.append(block)
            if "example" not in block or pd.concat(parts)["example"].nunique() >= prompts:
                break
        frame = pd.concat(parts, ignore_index=True) if parts else self.to_pandas().iloc[:0]
        if "example" not in frame:
            return self.to_pandas()
        keep = pd.unique(frame["example"])[:prompts]
        return frame[frame["example"].isin(keep)].reset_index(drop=True)


def load_run(folder: str | Path) -> Any:
    """The Result of a saved run folder (no figures: those need the operation's objects; index.html has them)."""
    from .result import Result

    path, manifest = read_run_manifest(folder)
    json_columns = manifest.get("json_columns") or {}
    table = read_table(_table_file(path, "table"), list(json_columns.get("table", [])))
    per_prompt = None
    if "per_prompt.parquet" in manifest["files"]:
        per_prompt = SavedTable(_table_file(path, "per_prompt"), list(json_columns.get("per_prompt", [])))
    from .claims import Takeaway

    takeaway = Takeaway(manifest["takeaway"], (), manifest.get("takeaway_lead_end"))  # its lead mark kept
    result = Result(manifest["operation"], table, per_prompt=per_prompt, title=manifest.get("title"),
                    takeaway=takeaway, blank_note=manifest.get("blank_note", ""))
    result.manifest = manifest
    result.warnings = list(manifest.get("warnings") or [])
    result.tables = {str(name): read_table(_table_file(path, str(name)), []) for name in manifest.get("tables") or []}
    return result
