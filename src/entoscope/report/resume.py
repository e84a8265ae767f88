"""An interrupted report goes on where it stopped: `entoscope report` run again (or with `--resume`).

The report is written in a hidden partial folder beside `out` (results/folder.py `writing_run`), held by
its writer. Each step that finishes (the task scores, each section) leaves a record in the partial
folder's `.resume/`: what the step returned (a section's title, lead with its claims, body and terms; the
task scores) and the SHA-256 of every file in the section's folder, under the report's key, and sealed (the
SHA-256 of the record's own content). It is written beside and renamed into place after the step's files,
so a record means its step is whole. Ctrl-C keeps the partial folder when a step has finished (a killed
process leaves it anyway); nothing else is kept.

A later report into the same `out` takes over a leftover partial folder that no live writer holds when
its key is this report's: the model's fingerprint (every byte of its weights), `--quick` or full, the
sections, the package versions and a digest of entoscope's own source. A step is reused only when its
record is sound (seal, key) and every file it lists has its digest, with no other file in its folder;
otherwise its folder is removed and the step runs again (warning `report_step_damaged`). A leftover made
with other settings is removed and the report starts again (warning `report_restarted`), or, with
`--resume` (`resume=True`), refused before the first forward (`report_resume_mismatch`): two reports are
never mixed. Sections that failed or were skipped are tried again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import SaveError, warn
from .preflight import NotRun
from .section import Section

RECORDS = ".resume"
KEY_FILE = "report.json"
FORMAT = 1


def report_key(a: Any, quick: bool, chosen: list[str]) -> dict[str, Any]:
    """What a report's steps depend on: two reports with the same key compute the same files."""
    from ..models.fingerprint import model_fingerprint
    from ..results.manifest import package_versions

    return {"format": FORMAT, "model": {"name": a.name, "fingerprint": model_fingerprint(a.module)},
            "quick": bool(quick), "sections": list(chosen), "versions": package_versions(),
            "source": source_digest()}


def source_digest() -> str:
    """SHA-256 over entoscope's own .py files (their paths and bytes): an edited install never reuses the
    steps of the code before the edit."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=_plain).encode()).hexdigest()


def _plain(v: Any) -> Any:
    from ..results.claims import _plain as plain

    return plain(v)


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """In words, what differs between this report's key (`mine`) and an interrupted one's (`theirs`)."""
    words = []
    if mine.get("model") != theirs.get("model"):
        name = (theirs.get("model") or {}).get("name")
        words.append(f"another model ({name!r}, other weights)" if name != mine["model"]["name"] else
                     f"the model {name!r} with other weights")
    if mine.get("quick") != theirs.get("quick"):
        words.append("it is a --quick report and this one the full report" if theirs.get("quick") else
                     "it is the full report and this one a --quick report")
    if mine.get("sections") != theirs.get("sections"):
        words.append(f"its sections are {', '.join(theirs.get('sections') or [])}; this one's "
                     f"{', '.join(mine.get('sections') or [])}")
    if mine.get("versions") != theirs.get("versions") or mine.get("source") != theirs.get("source") or \
            mine.get("format") != theirs.get("format"):
        words.append("another version of entoscope or of its packages")
    return "; ".join(words) or "another report"


class Checkpoints:
    """The records of a report's finished steps in `folder/.resume` (see the module docstring)."""

    def __init__(self, folder: Path, key: dict[str, Any]) -> None:
        self.folder, self.key, self.key_digest = Path(folder), key, _digest(key)
        self.records = self.folder / RECORDS
        self.reused: list[str] = []

    # ------------------------------------------------------------------ the partial folder as a whole
    @staticmethod
    def stored_key(folder: Path) -> dict[str, Any] | None:
        """The key an (interrupted) report's partial folder was written under; None if it has none."""
        try:
            doc = json.loads((Path(folder) / RECORDS / KEY_FILE).read_text(encoding="utf-8"))
            return doc["key"] if doc.get("digest") == _digest(doc["key"]) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def start(self) -> None:
        """Mark the folder as this report's (before any step is written)."""
        self.records.mkdir(parents=True, exist_ok=True)
        _write_json(self.records / KEY_FILE, {"key": self.key, "digest": self.key_digest})

    def any_done(self) -> bool:
        return self.records.is_dir() and any(p.suffix == ".json" and p.name != KEY_FILE
                                             for p in self.records.iterdir())

    def finish(self) -> None:
        """The report is whole: the records go (the folder becomes the report)."""
        shutil.rmtree(self.records, ignore_errors=True)

    # ------------------------------------------------------------------ one step
    def _path(self, step: str) -> Path:
        name = step if re.fullmatch(r"[A-Za-z0-9_.-]+", step) else hashlib.sha256(step.encode()).hexdigest()[:16]
        return self.records / f"step-{name}.json"

    def save(self, step: str, value: dict[str, Any], where: Path | None = None) -> None:
        """Record `step` as finished with `value` (JSON), and the files of its folder `where`."""
        record = {"step": step, "key": self.key_digest, "value": value,
                  "files": _file_digests(where) if where is not None and where.is_dir() else None}
        record["seal"] = _digest(record)
        _write_json(self._path(step), record)

    def load(self, step: str, where: Path | None = None) -> dict[str, Any] | None:
        """A finished step's value, verified; None when it has no record. A record or folder that fails the
        checks is removed (its step runs again) with a warning."""
        path = self._path(step)
        if not path.exists():
            return None
        why = ""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            seal = record.pop("seal", None)
            if seal != _digest(record) or record.get("step") != step:
                why = "its record does not match its seal"
            elif record.get("key") != self.key_digest:
                why = "its record belongs to another report"
            elif record["files"] is not None and (where is None or _file_digests(where) != record["files"]):
                why = "a file of its folder is missing, changed or added since it was written"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            why = "its record cannot be read"
        if why:
            label = step.replace("-", " ", 1)
            warn(f"the interrupted report's step '{label}' cannot be trusted ({why}): it runs again",
                 code="report_step_damaged")
            path.unlink(missing_ok=True)
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)
            return None
        self.reused.append(step)
        return record["value"]


def section_value(sec: Section) -> dict[str, Any]:
    from ..results.claims import Takeaway

    lead = sec.lead.to_dict() if isinstance(sec.lead, Takeaway) else {"text": str(sec.lead), "claims": None}
    return {"title": sec.title, "lead": lead, "body": sec.body, "terms": list(sec.terms), "own_page": sec.own_page}


def section_of(value: dict[str, Any]) -> Section:
    from ..results.claims import Claim, Takeaway

    lead = value["lead"]
    text = lead["text"] if lead["claims"] is None else Takeaway(lead["text"], [Claim(**c) for c in lead["claims"]],
                                                                lead.get("lead_end"))
    return Section(value["title"], text, value["body"], tuple(value["terms"]), value["own_page"])


def not_run_value(n: NotRun) -> dict[str, Any]:
    return asdict(n)


def refuse_other(folder: Path, mine: dict[str, Any], theirs: dict[str, Any], target: Path) -> None:
    raise SaveError(f"the interrupted report of {target} (in {folder.name}) was made with other settings: "
                    f"{differences(mine, theirs)}", code="report_resume_mismatch",
                    remedy="resume with exactly the same command, or leave out --resume to start a new report "
                    "(the interrupted one is removed)")


def _file_digests(where: Path) -> dict[str, str]:
    out = {}
    for path in sorted(where.rglob("*")):
        if path.is_file() or path.is_symlink():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[path.relative_to(where).as_posix()] = h.hexdigest()
    return out


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Written beside and renamed: the file is whole or absent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, default=_plain))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
