"""Ray workers: actors that each load the model once (from the model spec) and run shards.

A worker is a Ray actor with `max_restarts` and `max_task_retries`: when its process dies (killed,
out of memory, a lost node), Ray starts it again, it loads the model again, and the shard it was
running is re-run. The driver writes each shard's per-prompt arrays to the shard store as soon as it
returns, so the driver holds at most one shard per worker in memory. The last pool is kept for the life
of the driver process, so a second run with the same spec and resources reuses the loaded replicas; a run
that needs another pool ends it first (its resources are freed for the new one);
`entoscope.executors.shutdown()` ends it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, EntoscopeError
from ..prepared import Prepared
from .config import Ray
from .contract import Sharded
from .shards import PerPrompt, Shard
from .spec import ModelSpec

if TYPE_CHECKING:
    from ..data.examples import Dataset

_POOLS: dict[Any, RayPool] = {}
_STARTED_HERE = False


@dataclass(frozen=True)
class Job:
    """What every worker of a run receives once (put in Ray's object store): the operation and the data to
    prepare, the run's key, the digest of the driver's shard plan and the driver model's fingerprint."""

    op: Sharded
    data: Dataset | None
    key: str
    plan: str
    fingerprint: str | None


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray executor needs the ray package, which is not installed", code="ray_missing",
                          remedy="pip install 'entoscope[ray]', or run in-process (leave executor out)") from None
    return ray


def connect(executor: Ray) -> Any:
    """Join the cluster the executor names, or start a local one (once per driver process): ray_cluster.py."""
    global _STARTED_HERE
    from .ray_cluster import connect as join

    ray, started = join(executor)
    _STARTED_HERE = _STARTED_HERE or started
    return ray


class _Worker:
    """One model replica (becomes a Ray actor class in `RayPool`)."""

    def __init__(self, spec: ModelSpec, threads: int, niceness: int | None = None) -> None:
        import torch

        from ..models.fingerprint import model_fingerprint

        torch.set_num_threads(max(1, threads))
        if niceness is not None:  # Ray starts workers niced (15); the model work runs at the driver's priority
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
        os.environ.setdefault("ENTOSCOPE_QUIET", "1")
        import ray

        self.prepared: tuple[str, Sharded, Prepared[Any]] | None = None  # (run key, operation, its prepare)
        self.failed: EntoscopeError | None = None
        try:  # a worker that cannot load its replica reports why (its first call raises it), not worker_lost
            self.model = spec.load([int(g) for g in ray.get_gpu_ids()])
            self.fingerprint_ = model_fingerprint(self.model)
        except EntoscopeError as err:
            self.failed = err
        except Exception as err:  # noqa: BLE001 - a node's own trouble: missing files, out of memory, ...
            self.failed = EntoscopeError(f"a Ray worker could not load its replica of the model ({spec.describe()}): "
                                         f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                                         code="worker_start_failed", remedy="make the model (and entoscope) "
                                         "loadable on every node: the same folder path, packages and memory")

    def pid(self) -> int:
        return os.getpid()

    def fingerprint(self) -> str:
        if self.failed is not None:
            raise self.failed
        return self.fingerprint_

    def run(self, job: Job, phase: str, shard: Shard, context: Any) -> tuple[PerPrompt, list[dict]]:
        from ..errors import recording_warnings

        if job.fingerprint != self.fingerprint_:
            raise ConfigError("this worker's replica of the model has other weights than the driver's model",
                              code="worker_model_differs", remedy="load the model from a saved folder on both (the "
                              "spec loads it again on every worker), or pass a factory function")
        op = job.op
        with recording_warnings() as warned:
            if self.prepared is None or self.prepared[0] != job.key:
                self.prepared = None  # free the previous run's state first
                prepared = op.prepare_for(self.model, job.data)
                from .shards import digest

                if digest(op.shard_batches(prepared)) != job.plan:
                    raise ConfigError("the worker's batches differ from the driver's (another tokenizer or entoscope "
                                      "version on the worker?)", code="worker_plan_differs",
                                      remedy="install the same entoscope, transformers and model on every node")
                self.prepared = (job.key, op, prepared)
            _, op, prepared = self.prepared
            prepared.contexts[phase] = context
            with prepared.model.evaluating():
                part = op.execute_shard(prepared, phase, list(shard.batches), quiet=True)
        return part, warned


class RayPool:
    def __init__(self, executor: Ray, spec: ModelSpec) -> None:
        ray = connect(executor)
        self.executor = executor
        resources = dict(executor.resources_per_worker)
        cpus, gpus = resources.pop("CPU", 1.0), resources.pop("GPU", 0.0)
        self._check_resources(ray, executor)
        actor = ray.remote(_Worker)
        options = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": executor.max_retries,
                   "max_task_retries": executor.max_retries}
        if resources:
            options["resources"] = resources
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.actors = [actor.options(**options).remote(spec, int(cpus) or 1, nice) for _ in range(executor.workers)]
        try:
            self.fingerprints = self._get([a.fingerprint.remote() for a in self.actors])
        except BaseException:  # a worker that could not start: free every worker's resources for the next pool
            self.kill()
            raise

    def _check_resources(self, ray: Any, executor: Ray, wait_s: float = 20.0) -> None:
        """Refuse workers the cluster cannot place (else Ray would wait for them forever); resources of a
        pool just ended come back within moments, so free ones are awaited a little."""
        need = {name: per * executor.workers for name, per in executor.resources_per_worker.items()}
        total = ray.cluster_resources()
        for name, amount in need.items():
            if amount > total.get(name, 0) + 1e-9:
                raise ConfigError(f"{executor.workers} workers need {amount:g} {name} in all; the Ray cluster has "
                                  f"{total.get(name, 0):g}", code="ray_not_enough_resources",
                                  remedy="use fewer workers or smaller resources_per_worker, or add nodes")
        deadline = time.monotonic() + wait_s
        while True:
            free = ray.available_resources()
            short = [n for n, amount in need.items() if amount > free.get(n, 0) + 1e-9]
            if not short:
                return
            if time.monotonic() > deadline:
                raise ConfigError(f"{executor.workers} workers need {need[short[0]]:g} {short[0]}; only "
                                  f"{free.get(short[0], 0):g} of the cluster's {total.get(short[0], 0):g} are free "
                                  "(other jobs hold the rest)", code="ray_not_enough_resources",
                                  remedy="use fewer workers, wait for the other jobs, or add nodes")
            time.sleep(0.2)

    def pids(self) -> list[int]:
        return self._get([a.pid.remote() for a in self.actors])

    def _get(self, refs: Any) -> Any:
        ray = require_ray()
        try:
            return ray.get(refs)
        except Exception as err:  # noqa: BLE001 - a worker's refusal reaches the user as itself
            raise _unwrap(err) from None

    def run_phase(self, job_ref: Any, phase: str, shards: list[Shard], context: Any, store: Any,
                  on_done: Any) -> list[list[dict]]:
        """Run `shards` (those not in the store yet), writing each to the store as it returns."""
        ray = require_ray()
        todo = [s for s in shards if not store.has(phase, s)]
        context_ref = ray.put(context)
        idle = list(self.actors)
        in_flight: dict[Any, tuple[Shard, Any, float]] = {}
        warned: list[list[dict]] = []
        while todo or in_flight:
            while idle and todo:
                worker, shard = idle.pop(0), todo.pop(0)
                in_flight[worker.run.remote(job_ref, phase, shard, context_ref)] = (shard, worker, time.perf_counter())
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                shard, worker, _t0 = in_flight.pop(ref)
                part, w = self._get(ref)
                store.write(phase, shard, part)
                warned.append(w)
                del part
                idle.append(worker)
                on_done(shard)
        return warned

    def kill(self) -> None:
        ray = require_ray()
        for a in self.actors:
            ray.kill(a)


def _unwrap(err: Exception) -> Exception:
    """A worker's EntoscopeError as itself; a worker that died past its retries as `worker_lost`."""
    ray = require_ray()
    cause = getattr(err, "cause", None)
    if isinstance(err, EntoscopeError) and not isinstance(err, ray.exceptions.RayError):
        return err
    if isinstance(cause, EntoscopeError):
        return cause
    if isinstance(err, ray.exceptions.RayActorError):
        return EntoscopeError(f"a Ray worker died and could not be restarted ({' '.join(str(err).split())[:200]})",
                              code="worker_lost", remedy="rerun with --resume (finished shards are kept); raise "
                              "max_retries, or give workers more memory")
    if isinstance(err, ray.exceptions.RayTaskError) and cause is not None:
        return cause if isinstance(cause, Exception) else err
    return err


def pool_for(executor: Ray, spec: ModelSpec) -> RayPool:
    key = (executor.address, executor.workers, tuple(sorted(executor.resources_per_worker.items())),
           executor.max_retries, repr(spec.source), repr(spec.cache), id(spec.factory) if callable(spec.factory)
           else spec.factory)
    pool = _POOLS.get(key)
    if pool is None:
        for old in list(_POOLS.values()):  # one pool at a time: its replicas' memory and resources are freed
            with contextlib.suppress(Exception):
                old.kill()
        _POOLS.clear()
        pool = _POOLS[key] = RayPool(executor, spec)
    return pool


def worker_pids() -> list[int]:
    """Process ids of every live pool's workers (tests end one by its pid)."""
    return [pid for pool in _POOLS.values() for pid in pool.pids()]


def shutdown() -> None:
    """End every pool's workers, and the local Ray cluster if this process started it."""
    global _STARTED_HERE
    for pool in _POOLS.values():
        with contextlib.suppress(Exception):  # the cluster may be gone already
            pool.kill()
    _POOLS.clear()
    if _STARTED_HERE:
        from .ray_cluster import stop_watchdog

        require_ray().shutdown()
        stop_watchdog()
        _STARTED_HERE = False
