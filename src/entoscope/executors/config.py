"""Where an operation's work runs: here (`InProcess`, the default) or on a Ray cluster (`Ray`).

Both are configs like every other (ConfigModel), so Python, YAML and the command line spell them alike:

    op.run(model, data, executor=es.Ray(workers=4))
    executor: {type: ray, workers: 4, resources_per_worker: {GPU: 1}}       (a YAML entry)
    entoscope patch ... --executor ray --workers 4 [--address host:port] [--resume]

An executor never changes a number: sharded and in-process runs merge the same per-prompt values in
prompt order and summarise them with the same code (docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, field_serializer, field_validator

from ..config_model import ConfigModel
from ..errors import ConfigError


class InProcess(ConfigModel):
    """Run in this Python process: one shard, here."""

    type: Literal["in_process"] = Field(default="in_process", description="in_process: one shard, in this Python "
                                        "process")

    @property
    def workers(self) -> int:
        return 1


class Ray(ConfigModel):
    """Run shards of prompts on Ray workers, each holding its own replica of the model.

    address:              a running cluster ("host:port", "auto", "ray://host:10001"); None: the cluster
                          RAY_ADDRESS names, else one started on this machine with `ray start`, else a local
                          one started here (or the one this process already joined). "local" (here or in
                          RAY_ADDRESS): a new local cluster, as Ray means it; another "scheme://" is a Ray
                          client of that name, passed to ray.init as it is.
    workers:              model replicas (Ray actors); each loads the model once from the model spec.
    resources_per_worker: Ray resources of one worker, e.g. {CPU: 4, GPU: 1}; CPU sets the worker's torch threads.
    shard_size:           prompts per shard, rounded up to whole length-grouped batches; default: one batch
                          per shard (a killed worker or driver loses at most one batch's work).
    max_retries:          how often a worker is restarted, and its shard re-run, after it dies.
    factory:              "package.module:function" (or, from Python, a function) returning the model; for a
                          model built in Python that no saved spec can load again.
    connect_timeout_s:    how long a cluster at `address` (or RAY_ADDRESS) may take to answer before the run is
                          refused (`ray_unreachable`; executors/ray_cluster.py); default 30 s.
    """

    type: Literal["ray"] = Field(default="ray", description="ray: shards of prompts on Ray workers (docs/scale.md)")
    address: str | None = Field(default=None, description="Ray cluster address (host:port, auto); none: a local one")
    workers: int = Field(default=2, ge=1, le=10_000, description="model replicas (Ray actors)")
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0},
                                                   description="Ray resources per worker, e.g. {CPU: 4, GPU: 1}")
    shard_size: int | None = Field(default=None, ge=1, description="prompts per shard (whole batches); default: "
                                   "one batch per shard")
    max_retries: int = Field(default=3, ge=0, le=1000, description="restarts of a dead worker (its shard re-runs)")
    factory: Any = Field(default=None, description="'module:function' that returns the model (workers call it)")
    connect_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="seconds to wait for a cluster at "
                                     "address (or RAY_ADDRESS) to answer before refusing (ray_unreachable)")

    @field_validator("resources_per_worker")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        if any(x < 0 for x in v.values()):
            raise ValueError("resources must be >= 0")
        return v

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: Any) -> Any:
        if v is None or callable(v):
            return v
        if isinstance(v, str) and ":" in v and all(v.split(":", 1)):
            return v
        raise ValueError("factory is 'package.module:function' (or, from Python, a function)")

    @field_serializer("factory")
    def _factory_name(self, v: Any) -> Any:
        if callable(v):
            return f"{getattr(v, '__module__', '?')}:{getattr(v, '__qualname__', repr(v))}"
        return v

    def cpus(self) -> float:
        return float(self.resources_per_worker.get("CPU", 1.0))

    def gpus(self) -> float:
        return float(self.resources_per_worker.get("GPU", 0.0))

    def factory_function(self) -> Callable[[], Any] | None:
        """The factory as a function (imported from 'module:function' where given as a string)."""
        if self.factory is None or callable(self.factory):
            return self.factory
        import importlib

        module, _, name = self.factory.partition(":")
        try:
            target: Any = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"factory {self.factory!r} cannot be imported ({err})", code="factory_not_found",
                              remedy="name a function importable on every worker: 'package.module:function'") from None
        if not callable(target):
            raise ConfigError(f"factory {self.factory!r} is not a function", code="factory_not_found",
                              remedy="name a function that returns the model")
        return target


Executor = Annotated[InProcess | Ray, Field(discriminator="type")]
NAMES = {"in_process": InProcess, "ray": Ray}


def as_executor(value: Any) -> InProcess | Ray:
    """An executor from None (in-process), a config object, a name or a mapping ({type: ray, workers: 4})."""
    if value is None:
        return InProcess()
    if isinstance(value, (InProcess, Ray)):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if isinstance(value, dict):
        kind = value.get("type", "in_process")
        if kind not in NAMES:
            raise ConfigError(f"executor: unknown type {kind!r}", code="unknown_executor",
                              remedy="use type: in_process or type: ray")
        return NAMES[kind](**value)
    raise ConfigError(f"executor: expected es.InProcess(), es.Ray(...) or a mapping, got {type(value).__name__}",
                      code="unknown_executor", remedy="pass executor=es.Ray(workers=2), or leave it out")
