"""Named plug-ins: methods, metrics, patch values, poolings, operations.

Everything a config names by a string is looked up here, so a user's own function registered from
Python works from YAML and the command line like a built-in:

    @entoscope.register("metric", "answer_margin")
    def answer_margin(logits, answers, reference=None): ...
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import UnknownNameError

T = TypeVar("T")
_REGISTRY: dict[str, dict[str, Any]] = defaultdict(dict)

# The modules that register each kind's built-ins, imported when the kind is first looked up (importing
# `entoscope` imports none of them). A new built-in in a new module is one entry here.
BUILTIN_MODULES: dict[str, tuple[str, ...]] = {
    "operation": ("entoscope.lens.operation", "entoscope.lens.parameter", "entoscope.patching.operation",
                  "entoscope.probing.operation", "entoscope.circuits.operation", "entoscope.circuits.dla",
                  "entoscope.circuits.head_scores", "entoscope.circuits.ifr", "entoscope.dictionaries.dla",
                  "entoscope.dictionaries.lens", "entoscope.dictionaries.graph", "entoscope.steering.operation",
                  "entoscope.lens.jacobian_fit", "entoscope.interchange.operation",
                  "entoscope.lens.compare", "entoscope.lens.coordinate_patch", "entoscope.inspection.operation"),
    "metric": ("entoscope.metrics",),
    "patch": ("entoscope.patching.values",),
    "pooling": ("entoscope.probing.pooling",),
    "head_pooling": ("entoscope.probing.pooling",),
    "report_section": ("entoscope.report.sections",),
}
_LOADED: set[str] = set()


def _builtins(kind: str) -> dict[str, Any]:
    if kind not in _LOADED:
        _LOADED.add(kind)
        for module in BUILTIN_MODULES.get(kind, ()):
            importlib.import_module(module)
    return _REGISTRY[kind]


def register(kind: str, name: str | None = None, *, replace: bool = False) -> Callable[[T], T]:
    """Decorator: register `obj` under (kind, name); the name defaults to the object's __name__."""
    def decorate(obj: T) -> T:
        key = name or getattr(obj, "name", None) or getattr(obj, "__name__")
        module = str(getattr(obj, "__module__", ""))
        if not any(module == m or module.startswith(m + ".") for m in BUILTIN_MODULES.get(kind, ())):
            _builtins(kind)  # a user's entry comes after the built-ins, as when importing entoscope loaded them
        if key in _REGISTRY[kind] and not replace and _REGISTRY[kind][key] is not obj:
            raise ValueError(f"a {kind} named {key!r} is already registered; pass replace=True to override")
        _REGISTRY[kind][key] = obj
        return obj
    return decorate


def lookup(kind: str, name: str) -> Any:
    """The object registered as (kind, name), or a refusal listing the known names."""
    table = _REGISTRY[kind] if name in _REGISTRY.get(kind, {}) else _builtins(kind)
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise UnknownNameError(f"no {kind} named {name!r}", code=f"unknown_{kind.replace(' ', '_')}",
                               remedy=f"known {kind}s: {known}; register your own with "
                               f"@entoscope.register({kind!r}, {name!r})")
    return table[name]


def names(kind: str) -> list[str]:
    return sorted(_builtins(kind))
