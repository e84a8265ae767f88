"""Every error entoscope raises on purpose: a stable code, what went wrong, and the remedy.

Each refusal subclasses `EntoscopeError` and the builtin it resembles (ValueError, TypeError,
KeyError...), so `except ValueError` keeps working and a caller can branch on `err.code`.
The codes are listed in docs/errors.md; a test keeps that list and this module in step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextvars import ContextVar


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


_RECORDED: ContextVar[list[dict[str, str]] | None] = ContextVar("entoscope_warnings", default=None)


def warn(message: str, *, code: str) -> None:
    """Warn loudly (an EntoscopeWarning) and record it in the manifest of the run in progress."""
    log = _RECORDED.get()
    if log is not None and not any(w["code"] == code and w["message"] == message for w in log):
        log.append({"code": code, "message": message})
    warnings.warn(EntoscopeWarning(message, code=code), stacklevel=2)


def recorded_warnings() -> list[dict[str, str]]:
    """The warnings recorded so far by the run in progress ([] outside a run)."""
    return list(_RECORDED.get() or [])


@contextlib.contextmanager
def recording_warnings() -> Iterator[list[dict[str, str]]]:
    """Collect the `warn` calls made inside the block (Operation.run keeps them in the manifest)."""
    log: list[dict[str, str]] = []
    token = _RECORDED.set(log)
    try:
        yield log
    finally:
        _RECORDED.reset(token)
