"""Every error entoscope raises on purpose: a stable code, what went wrong, and the remedy.

Each refusal subclasses `EntoscopeError` and the builtin it resembles (ValueError, TypeError,
KeyError...), so `except ValueError` keeps working and a caller can branch on `err.code`.
The codes are listed in docs/errors.md; a test keeps that list and this module in step.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any


class EntoscopeError(Exception):
    """Base of every deliberate refusal. `code` is stable; `remedy` says what to do instead."""

    code: str = "entoscope_error"

    def __init__(self, message: str, *, remedy: str = "", code: str | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.remedy = remedy
        text = f"[{self.code}] {message}"
        if remedy:
            text += f"\n  Remedy: {remedy}"
        super().__init__(text)

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0] if self.args else ""

    def one_line(self) -> str:
        """`[code] message. Remedy: ...` on one line (what the command line prints)."""
        text = " ".join(f"[{self.code}] {self.message}".split())
        if self.remedy:
            text = text.rstrip(".") + ". Remedy: " + " ".join(self.remedy.split())
        return text


class UnsupportedModelError(EntoscopeError, TypeError):
    """The object is not a model entoscope accepts, or its family cannot be described."""

    code = "unsupported_model"


class ModelLoadError(EntoscopeError, OSError):
    """A model could not be loaded (unreachable hub, missing folder, ...)."""

    code = "model_load_failed"


class SiteError(EntoscopeError, ValueError):
    """An activation site that the model does not have, or an index out of range."""

    code = "site_invalid"


class UnknownNameError(EntoscopeError, KeyError):
    """A name (activation, method, metric, ...) that is not known."""

    code = "unknown_name"


class DataError(EntoscopeError, ValueError):
    """Input data that cannot be used as given (lengths, answers, labels, ...)."""

    code = "data_invalid"


class ConfigError(EntoscopeError, ValueError):
    """A configuration (Python, YAML or command line) that does not validate."""

    code = "config_invalid"


class CheckFailedError(EntoscopeError, ArithmeticError):
    """A run-time identity check failed: the numbers cannot be trusted, so none are returned."""

    code = "check_failed"


class DictionaryError(EntoscopeError, ValueError):
    """A sparse autoencoder or transcoder that cannot be read or used as given."""

    code = "dictionary_invalid"


class MetricError(EntoscopeError, RuntimeError):
    """A metric that failed when called, or returned something other than one value per row."""

    code = "metric_failed"


class SaveError(EntoscopeError, OSError):
    """A result could not be written (full disk, read-only folder, a file where a folder belongs)."""

    code = "save_failed"


class RemoteRunError(EntoscopeError, ConnectionError):
    """A remote run (nnsight / NDIF) that cannot be sent, is refused, or does not answer in time."""

    code = "remote_failed"


class EntoscopeWarning(UserWarning):
    """A recorded warning: the run went on, and the manifest says what was changed or doubtful."""

    def __init__(self, message: str, *, code: str = "warning") -> None:
        self.code = code
        self.message = message
        super().__init__(f"[{code}] {message}")


Record = dict[str, Any]  # {"code", "message", "count"}: one warning of a run, said `count` times
_RECORDED: ContextVar[list[Record] | None] = ContextVar("entoscope_warnings", default=None)
_HELD: ContextVar[dict[str, int] | None] = ContextVar("entoscope_held_warnings", default=None)
_SHOWN: set[tuple[str, str]] = set()  # (code, message) already shown in this process


def _action(text: str, module: str, lineno: int) -> str:
    """What the warnings filters do with an EntoscopeWarning of this text from this place."""
    for action, message, category, mod, line in warnings.filters:
        if (message is None or message.match(text)) and issubclass(EntoscopeWarning, category) and \
                (mod is None or mod.match(module)) and (line == 0 or line == lineno):
            return action
    return warnings.defaultaction


def _show(message: str, code: str, depth: int) -> None:
    """One line on stderr, `module:line: EntoscopeWarning: [code] message`, through the warnings filters
    (so `-W error`, `pytest.warns` and `filterwarnings` work). Under the default action a message is shown
    once per process, like Python's own "default" (whose memory a `catch_warnings` elsewhere would reset)."""
    frame = sys._getframe(depth + 1)
    module, lineno = frame.f_globals.get("__name__", "entoscope"), frame.f_lineno
    if _action(f"[{code}] {message}", module, lineno) in ("default", "module", "once"):
        if (code, message) in _SHOWN:
            return
        _SHOWN.add((code, message))
    # the module name as the file: no source line printed under the message (one line per warning)
    warnings.warn_explicit(EntoscopeWarning(message, code=code), EntoscopeWarning, module, lineno,
                           module=module, registry={})


def warn(message: str, *, code: str, count: int = 1) -> None:
    """Warn (an EntoscopeWarning) and record it in the manifest of the run in progress.

    Said once: inside a run the same warning again only counts (`count` in the record), and a second
    warning of the same code is recorded but not shown; the run ends with one line saying how many more
    of that code it recorded (all of them are in result.warnings, the manifest and the page). count: how
    many times it was said (a worker's record raised again on the driver)."""
    log, held = _RECORDED.get(), _HELD.get()
    if log is not None and held is not None:
        for w in log:
            if w["code"] == code and w["message"] == message:
                w["count"] += count
                return
        log.append({"code": code, "message": message, "count": count})
        if code in held:
            held[code] += 1
            return
        held[code] = 0
    _show(message, code, depth=1)


def recorded_warnings() -> list[Record]:
    """The warnings recorded so far by the run in progress ([] outside a run)."""
    return list(_RECORDED.get() or [])


@contextlib.contextmanager
def recording_warnings() -> Iterator[list[Record]]:
    """Collect the `warn` calls made inside the block (Operation.run keeps them in the manifest)."""
    log: list[Record] = []
    held: dict[str, int] = {}
    token, held_token = _RECORDED.set(log), _HELD.set(held)
    try:
        yield log
    finally:
        _RECORDED.reset(token)
        _HELD.reset(held_token)
        for code, more in held.items():
            if more:
                _show(f"{more} more warning{'s' if more > 1 else ''} of this kind in this run (result.warnings and "
                      "the manifest list them all)", code, depth=2)
