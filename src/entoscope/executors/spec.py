"""The model spec: how a worker loads its own replica of the driver's model.

It is what the manifest already records about a loaded model (`load_model` writes it on the model:
`_entoscope_source`): the load source ("demo", a folder, a hub name), backend, compatibility mode,
dtype, device or device_map, revision; plus the CachedModel around it (its cache directory and modes).
Workers never receive the model itself through the driver: a replica is loaded on each worker, and its
weights' fingerprint is checked against the driver's before any shard runs (a model changed in memory
after loading, or a different folder on a worker's machine, is refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

NO_SOURCE_REMEDY = ("save it to a folder (model.save_pretrained(folder) and the tokenizer beside it) and load it "
                    "with es.load_model(folder), or pass a factory function: es.Ray(factory=make_model) "
                    "(or factory: 'package.module:function' in YAML) that builds the model on each worker")


@dataclass(frozen=True)
class ModelSpec:
    """Everything a worker needs to load the model again (picklable, small)."""

    source: dict[str, Any] | None  # load_model's arguments, or None when a factory builds the model
    cache: dict[str, Any] | None = None  # CachedModel's arguments around it, if any
    factory: Any = None  # a function (or 'module:function') returning the model
    fingerprint: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, model: Any, factory: Any = None) -> ModelSpec:
        """The spec of a model as the user passed it; refuses one that no worker could load again."""
        from ..models.adapter import ModelAdapter, _split, module_of

        if isinstance(model, ModelAdapter):
            cached = model.runner if getattr(type(model.runner), "_entoscope_wrapper", False) else None
        else:
            _, cached = _split(model)
        cache = None
        if cached is not None:
            cache = {"cache_dir": None if cached.cache_dir is None else str(cached.cache_dir), "verify": cached.verify,
                     "dedupe_rows": cached.dedupe_rows, "grad": cached.grad}
        source = getattr(module_of(model), "_entoscope_source", None)
        if factory is None and source is None:
            raise ConfigError("this model was built in Python and has no load source, so Ray workers cannot load "
                              "their own replica (a model is never pickled through the driver)",
                              code="no_model_source", remedy=NO_SOURCE_REMEDY)
        return cls(source=None if factory is not None else dict(source), cache=cache, factory=factory)

    def describe(self) -> str:
        if self.source is None:
            name = self.factory if isinstance(self.factory, str) else getattr(self.factory, "__qualname__", "factory")
            return f"factory {name}"
        s = self.source
        parts = [repr(s["name"]), s["backend"]] + (["compat"] if s.get("compat") else []) + [str(s.get("dtype"))]
        if s.get("device_map") is not None:
            parts.append(f"device_map {s['device_map']!r}")
        elif s.get("device"):
            parts.append(f"device {s['device']}")
        return " ".join(parts) + (" (CachedModel)" if self.cache else "")

    def load(self, gpu_ids: list[int] | None = None) -> Any:
        """Load the replica on this worker (Ray has made its GPUs, if any, the only visible ones)."""
        if self.source is None:
            from .config import Ray

            fn = Ray(factory=self.factory).factory_function()
            assert fn is not None
            model = fn()
        else:
            from ..models.loading import load_model

            s = dict(self.source)
            device = worker_device(s.get("device"), gpu_ids or [])
            dtype = str(s.get("dtype", "float32")).removeprefix("torch.")
            model = load_model(s["name"], backend=s["backend"], compat=bool(s.get("compat")), device=device,
                               dtype=dtype, revision=s.get("revision"), device_map=s.get("device_map"))
        if self.cache is not None:
            from ..models.cached import CachedModel

            model = CachedModel(model, **self.cache)
        return model


def worker_device(device: str | None, gpu_ids: list[int]) -> str | None:
    """The driver's device as seen on a worker: Ray shows a worker only its own GPUs, so cuda:N -> cuda."""
    if device is not None and device.startswith("cuda") and gpu_ids:
        return "cuda"
    return device
