"""Lazy package attributes (PEP 562): a package lists its public names and the module each lives in, and a
name's module is imported when the name is first used, so `import entoscope` (and `entoscope --help`) loads
no torch, transformers or pandas until something needs them.

    __getattr__, __dir__ = lazy_exports(__name__, {"Lens": ".lens.operation", "errors": ".errors:",
                                                   "load_dictionary": ".dictionaries:get_dictionary"})

A value is "module" (its attribute of the same name), "module:attr" (another attribute) or "module:" (the
module itself); modules are relative to the package. Any other name that is a sub-module of the package is
imported on first use too, as an eager `import` of it would have made it an attribute.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`, whose public names are the keys of `exports`."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            if name.startswith("__"):
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module_name, colon, attr = target.partition(":")
        module = importlib.import_module(module_name, package)
        value = module if colon and not attr else getattr(module, attr or name)
        setattr(sys.modules[package], name, value)  # kept: later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
