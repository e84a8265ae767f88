"""manifest.json: everything needed to know what a run was and to repeat it.

It holds the operation's full config, the model's identity (name, how it was loaded, structure,
fingerprint of its weights), the data (its spec and its records), package versions, seed and timings.
`entoscope run runs/x/manifest.json` rebuilds the operation, the model and the data from it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import platform
from typing import Any

from ..data.examples import Dataset
from ..models.adapter import ModelAdapter

FORMAT_VERSION = 1


def package_versions() -> dict[str, str]:
    return dict(_versions())


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    """Read once per process."""
    from ..versions import installed_version

    out = {"python": platform.python_version()}
    for pkg in ("entoscope", "torch", "transformer-lens", "transformers", "numpy", "pandas", "plotly"):
        out[pkg] = installed_version(pkg) or "not installed"
    return tuple(out.items())


def model_identity(model: ModelAdapter) -> dict[str, Any]:
    """Name, source, structure and the weights' fingerprint; the fingerprint (a hash of every byte) is made
    when first read, e.g. when the manifest is saved (models/fingerprint.py `deferred_fingerprint`)."""
    from ..models.fingerprint import deferred_fingerprint
    from .lazy import LazyDict

    return LazyDict({"name": model.name, "source": getattr(model.module, "_entoscope_source", None),
                     "structure": model.structure.as_dict()}, {"fingerprint": deferred_fingerprint(model.module)})


def data_record(data: Dataset | None) -> dict[str, Any] | None:
    if data is None:
        return None
    return {"name": data.name, "n": len(data), "spec": dict(data.params), "records": data.to_records()}


def build_manifest(operation: Any, model: ModelAdapter, data: Dataset | None,
                   timings: dict[str, float], warnings: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "operation": operation.name,
        "config": operation.model_dump(mode="json"),
        "model": model_identity(model),
        "data": data_record(data),
        "seed": getattr(operation, "seed", None),
        "versions": package_versions(),
        "timings": timings,
        "warnings": list(warnings or []),
    }
