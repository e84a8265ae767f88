"""The report's sections checked before its first forward, and a section that cannot run or fails set aside.

A section function may say which operation runs it makes (`runs_by(fn)`: `(model, quick) -> [(operation,
data), ...]`). Before the task scores, every such run is prepared (`Operation.prepare_for`: the data built
under the model's tokenizer, the sites resolved, the metric checked, the plan made; it runs no model) and its
plan's memory beyond the loaded model is compared with the memory free now. A section one of whose runs is
refused is *skipped*: the report goes on without it, and its page and the report's index say why (the
refusal's code, message and remedy). A section that raises while it runs is *failed*: what it had written is
removed, the other sections are kept, and its page and the index say what it raised. Ctrl-C still stops the
whole report (nothing is saved, results/folder.py).
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import EntoscopeError

Runs = Callable[[Any, bool], list[tuple[Any, Any]]]
INTERNAL_REMEDY = ("a bug in entoscope or a case it does not check yet: run the section's operation alone with "
                   "--debug for the traceback and report it")


@dataclass
class NotRun:
    """A section the report did not write: `skipped` before the first forward, or `failed` while it ran."""

    section: str
    status: str  # "skipped" or "failed"
    code: str
    message: str
    remedy: str

    @classmethod
    def of(cls, section: str, status: str, err: BaseException) -> NotRun:
        if isinstance(err, EntoscopeError):
            return cls(section, status, err.code, " ".join(err.message.split()), err.remedy)
        text = " ".join(str(err).split())[:300]
        return cls(section, status, "internal_error", f"{type(err).__name__}: {text}", INTERNAL_REMEDY)

    def line(self) -> str:
        when = "skipped (checked before the report's first forward)" if self.status == "skipped" else \
            "failed while it ran"
        return f"section {self.section} {when}: [{self.code}] {self.message}. Remedy: {self.remedy}"

    def record(self) -> dict[str, str]:
        return asdict(self)

    def html(self) -> str:
        verb = "was skipped: the model cannot run it" if self.status == "skipped" else "failed while it ran"
        return (f'<p class="note">This section {verb} (<code>{html.escape(self.code)}</code>): '
                f"{html.escape(self.message)}.</p><p>Remedy: {html.escape(self.remedy)}.</p>")


def runs_by(runs: Runs) -> Callable[[Any], Any]:
    """Decorator of a section function: the (operation, data) runs it makes, for the preflight."""
    def attach(fn: Any) -> Any:
        fn.runs = runs
        return fn
    return attach


def preflight(model: Any, name: str, section: Any, quick: bool) -> NotRun | None:
    """Prepare each run of `section` (no model forward); a refusal, or more memory than is free, skips it."""
    runs = getattr(section, "runs", None)
    if runs is None:
        return None

    from .sizes import run_key, sharing_plans

    try:
        with warnings.catch_warnings(), sharing_plans() as fitted:  # said again, and recorded, when it runs
            warnings.simplefilter("ignore")
            for op, data in runs(model, quick):  # (sizing the section's screens prepares its runs: taken here)
                prepared = fitted.pop(run_key(op, data), None) or op.prepare_for(model, data)
                need = prepared.plan.peak_memory_bytes
                free = available_memory()
                if free is not None and need > free:
                    raise EntoscopeError(
                        f"{op.name} would need about {need / 2**30:.1f} GiB beyond the model, and "
                        f"{free / 2**30:.1f} GiB is free", code="section_memory",
                        remedy="free some memory, run the report with --quick, or run this operation alone with a "
                        "smaller memory (e.g. --memory 2GB)")
    except EntoscopeError as err:
        return NotRun.of(name, "skipped", err)
    except Exception as err:  # noqa: BLE001 - a section's own bug must not stop the others
        return NotRun.of(name, "skipped", err)
    return None


def available_memory() -> int | None:
    """Bytes of memory free now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
