"""The driver's side of a run: shard, execute (here or on Ray workers), merge, summarise.

    for each phase of the operation:
        context = op.before_phase(...)          the global step, on the driver (probe fitting, circuit choice)
        prepared.contexts[phase] = context      what every shard of the phase reads (here and on each worker)
        shards -> op.execute_shard(...)         per-prompt arrays of some prompts (here, or one per worker)
        merge(...)                              concatenation in prompt order, every prompt exactly once
    op.summarise(prepared, merged)              the aggregate and its intervals from the per-prompt values

`op` is any operation with the sharding contract (`Sharded`, executors/contract.py).

`merged` maps each phase to its PromptColumns (executors/columns.py): in memory for a run in one
process without a shard folder, else streamed from the shard files, so a run of any size summarises
with one shard or one bucket of prompts in memory.

In-process and on Ray the same functions run on the same batches, so the merged arrays are the same
(up to the floating-point differences of one device to another, none on CPUs).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, recorded_warnings, warn
from ..prepared import Prepared
from .config import InProcess, Ray
from .columns import PromptColumns, StoredColumns, merge
from .contract import Sharded
from .shards import IN_MEMORY_PROMPTS, PerPrompt, Shard, digest, plan_shards
from .spec import ModelSpec
from .store import ShardStore


def shards_of(op: Sharded, prepared: Prepared[Any], executor: InProcess | Ray, *, stored: bool = False) -> list[Shard]:
    """In-process without a shard folder: one shard; otherwise whole batches grouped by shard_size (the same
    plan on any executor, so a run started on Ray may resume here and the other way round)."""
    batches = op.shard_batches(prepared)
    return plan_shards(batches, getattr(executor, "shard_size", None), one=isinstance(executor, InProcess) and not stored)


def streams_in_process(n_examples: int) -> bool:
    """An in-process run of more than IN_MEMORY_PROMPTS prompts writes its shards (one batch each) to a
    temporary folder and merges them from there, as a Ray run does, so its per-prompt values are never
    all in memory; smaller runs keep their one shard."""
    return n_examples > IN_MEMORY_PROMPTS


def check_executor(name: str, not_sharded: str, model: Any, executor: InProcess | Ray, *,
                   connect: bool = True) -> ModelSpec | None:
    """Before any work: the operation `name` can be sharded (`not_sharded`: its reason why not, '' if it
    can), a Ray worker can load the model, and (connect=True, a run; a plan starts and reaches no cluster,
    so it needs no ray package either) the cluster answers."""
    if isinstance(executor, InProcess):
        return None
    if not_sharded:
        raise ConfigError(f"{name} cannot run on Ray: {not_sharded}", code="executor_unsupported",
                          remedy="leave executor out (in-process) for this configuration")
    spec = ModelSpec.of(model, factory=executor.factory)
    if not connect:
        return spec
    from .ray_cluster import check_reachable

    check_reachable(executor)  # a cluster that does not answer is refused now, within connect_timeout_s
    return spec


def run_sharded(op: Sharded, prepared: Prepared[Any], executor: InProcess | Ray, spec: ModelSpec | None, *, quiet: bool,
                shards_dir: str | Path | None, resume: bool) -> tuple[Any, dict[str, Any]]:
    """Run every phase over its shards and summarise; returns (Result, what the manifest records)."""
    n = len(prepared.data) if prepared.data is not None else 0
    here = isinstance(executor, InProcess)
    stored = shards_dir is not None or not here or streams_in_process(n)
    shards = shards_of(op, prepared, executor, stored=stored)
    phases = op.phases(prepared)
    fingerprint = None if here and shards_dir is None else _fingerprint(prepared.model)
    plan_digest = digest(op.shard_batches(prepared))
    temporary = stored and shards_dir is None
    folder = Path(tempfile.mkdtemp(prefix="entoscope-shards-")) if temporary else shards_dir
    store = None
    if folder is not None:  # what the shards belong to: a resumed run must be this very run
        # memory is left out: a Ray run fixes "auto" to the driver's free memory, which moves between runs;
        # what it decides (the batches and shards) is in the key already
        config = {k: v for k, v in op.config().items() if k not in ("memory", "memory_budget_mb")}
        run_key = digest({"config": config, "data": prepared.data.to_records() if prepared.data else None,
                          "model": fingerprint, "plan": plan_digest, "shards": [s.batches for s in shards],
                          "phases": list(phases)})
        store = ShardStore(folder, run_key, resume=resume)
    bar = _Bar(len(shards) * len(phases), quiet=quiet, workers=executor.workers)
    info: dict[str, Any] = {"executor": executor.model_dump(mode="json"), "shards": len(shards), "phases": list(phases),
                            "shard_examples": [len(s.examples) for s in shards]}
    try:
        pool = None
        if isinstance(executor, Ray):
            from .ray_pool import Job, pool_for, require_ray

            assert spec is not None
            pool = pool_for(executor, spec)
            info["model_spec"] = spec.describe()
            if any(fp != fingerprint for fp in pool.fingerprints):
                raise ConfigError("the workers' replicas of the model have other weights than the driver's model "
                                  "(changed in memory after loading, or another folder on a worker's machine)",
                                  code="worker_model_differs", remedy="save the changed model to a folder and load "
                                  "it from there, or pass a factory function that builds it")
            job = require_ray().put(Job(op, prepared.data, run_key, plan_digest, fingerprint))
        merged: dict[str, PromptColumns] = {}
        resumed = 0
        for phase in phases:
            context = op.before_phase(prepared, phase, merged)
            prepared.contexts[phase] = context
            if store is not None:
                store.begin_phase(phase, digest(context))
                done = [s for s in shards if store.has(phase, s)]
                resumed += len(done)
                for s in done:
                    bar.done(s, resumed=True)
            parts: list[PerPrompt] = []
            if pool is not None:
                for warned in pool.run_phase(job, phase, shards, context, store, bar.done):
                    _rewarn(warned)
            else:
                parts = _run_here(op, prepared, phase, shards, store, bar, quiet)
            # with a store every shard is on disk: the merge streams from there, one shard in memory at a time
            merged[phase] = merge(parts, n) if store is None else \
                StoredColumns([store.path(phase, s) for s in shards], shards, n,
                              [store.identity(phase, s) for s in shards])
            del parts
        bar.close()
        info["resumed_shards"] = resumed
        info["shard_files"] = [] if store is None or temporary else store.files()
        result = op.summarise(prepared, merged, quiet=quiet)
    finally:
        bar.close()
        if temporary and store is not None:
            store.remove()
    return result, info


def _run_here(op: Sharded, prepared: Prepared[Any], phase: str, shards: list[Shard], store: ShardStore | None, bar: Any,
              quiet: bool) -> list[PerPrompt]:
    """The shards run here; with a store each is written and dropped (nothing returned), else kept."""
    parts = []
    for s in shards:
        if store is not None and store.has(phase, s):
            continue
        # with several shards the shards' bar shows the progress, not one bar per shard
        part = op.execute_shard(prepared, phase, list(s.batches), quiet=quiet or len(shards) > 1)
        if store is not None:
            store.write(phase, s, part)
        else:
            parts.append(part)
        bar.done(s)
    return parts


def _fingerprint(model: Any) -> str:
    from ..models.fingerprint import model_fingerprint

    return model_fingerprint(model.module)


def _rewarn(warned: list[dict[str, str]]) -> None:
    """A worker's warnings, raised again on the driver (once each) so the run's record has them."""
    have = {(w["code"], w["message"]) for w in recorded_warnings()}
    for w in warned:
        if (w["code"], w["message"]) not in have:
            warn(w["message"], code=w["code"], count=w.get("count", 1))
            have.add((w["code"], w["message"]))


class _Bar:
    """One progress bar over every shard of every phase, with the prompts per second it sees."""

    def __init__(self, total: int, *, quiet: bool, workers: int) -> None:
        import os
        import sys

        self.t0 = time.perf_counter()
        self.prompts = 0
        self.workers = workers
        self.bar = None
        if total > 1 and not quiet and os.environ.get("ENTOSCOPE_QUIET") != "1" and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="shards", unit="shard", leave=False)

    def done(self, shard: Shard, resumed: bool = False) -> None:
        if self.bar is None:
            return
        if not resumed:
            self.prompts += len(shard.examples)
        rate = self.prompts / max(1e-9, time.perf_counter() - self.t0)
        self.bar.set_postfix_str(f"{rate:.1f} prompts/s on {self.workers} worker(s)", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
