"""The one life every operation follows: validate -> plan -> run (batched) -> Result.

An operation is a pydantic model: its fields ARE its config, so Python, YAML and the command line
are three spellings of one object, and `model_dump()` in the manifest re-runs exactly.
Subclasses implement `prepare` (every check `run` needs, plus the plan; runs no model) and
`execute` (the batched work). `plan()` calls only `prepare`, so a plan that says OK has already
passed every check on names, shapes and lengths that `run` makes.

An operation that splits into shards of prompts (`sharded = True`; docs/scale.md) implements, instead
of `execute`: `shard_batches` (its length-grouped batches), `execute_shard` (per-prompt arrays of some
batches), optionally `phases` / `before_phase` (a global step on the driver between sharded phases),
and `summarise` (the Result from the merged per-prompt arrays). Its `execute` is then "one shard,
here"; `run(..., executor=es.Ray(...))` runs the same shards on Ray workers.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import Field

from .config_model import ConfigModel
from .data.examples import Dataset
from .data.loading import load_data
from .errors import ConfigError, recording_warnings, warn
from .models.adapter import ModelAdapter, adapt
from .registry import register
from .stats import Stats

T = TypeVar("T")


@dataclass
class Plan:
    """What a run will cost, worked out without running the model.

    rows: the table's rows. forward_passes: prompt forwards (one prompt, or one copy of it, through the blocks
    it runs: a batch of B prompts is B; a run started part-way is one per prompt). backward_passes: prompt
    backwards. Where a number depends on the run's values the plan gives an upper bound and its notes say so
    (docs/operations.md); tests/test_conformance.py counts the real passes."""

    operation: str
    rows: int
    forward_passes: int
    backward_passes: int
    batch_sizes: list[int]
    peak_memory_bytes: int
    files: list[str] = field(default_factory=lambda: ["table.csv", "table.parquet", "index.html", "manifest.json"])
    notes: list[str] = field(default_factory=list)
    examples: int = 0
    executor: str = "in-process"
    shards: int = 1
    workers: int = 1
    passes_per_worker: int | None = None  # forward + backward passes of the busiest worker (estimate)
    memory_per_worker_bytes: int | None = None
    global_step: str = ""  # what runs on the driver between sharded phases

    def __str__(self) -> str:
        sizes = sorted(set(self.batch_sizes))
        lines = [
            f"plan: {self.operation}",
            f"  examples          {self.examples}",
            f"  rows              {self.rows}",
            f"  forward passes    {self.forward_passes} (batched: {len(self.batch_sizes)} batches of "
            f"{', '.join(map(str, sizes)) or '-'})",
            f"  backward passes   {self.backward_passes}",
            f"  peak memory       ~{self.peak_memory_bytes / 2**20:.1f} MiB (estimate)",
            f"  files             {', '.join(self.files)}",
        ]
        if self.executor != "in-process":
            memory = (self.memory_per_worker_bytes or 0) / 2**20
            lines += [f"  executor          {self.executor}: {self.shards} shards over {self.workers} workers",
                      f"  passes/worker     ~{self.passes_per_worker} (the busiest worker, forward + backward)",
                      f"  memory/worker     ~{memory:.1f} MiB (its replica and its batches)"]
        if self.global_step:
            lines.append(f"  on the driver     {self.global_step}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Prepared:
    """What `prepare` hands to `execute`: the adapter, the data and whatever the operation resolved."""

    model: ModelAdapter
    data: Dataset | None
    plan: Plan
    state: dict[str, Any] = field(default_factory=dict)


def register_operation(cls: type[T]) -> type[T]:
    """Class decorator: make an operation reachable by its `name` from YAML and the CLI."""
    return register("operation", cls.name)(cls)  # type: ignore[attr-defined]


class Operation(ConfigModel):
    """Base class of every operation (lens, patching, probing, circuits, ...)."""

    name: ClassVar[str] = "operation"
    needs_data: ClassVar[bool] = True

    batch_size: int | None = Field(default=None, ge=1, description="prompts per forward pass; default: "
                                   "chosen from memory_budget_mb")
    memory_budget_mb: float = Field(default=2048, gt=0, description="memory the batches may take")
    prepend_bos: bool = Field(default=True, description="prepend the BOS token to text prompts")
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="seed of every random choice the operation makes")
    stats: Stats = Field(default_factory=Stats, description="intervals and robust aggregation over prompts "
                         "(n_boot, ci_level, ci_method, degenerate_share, influence_share, fdr)")

    # ------------------------------------------------------------------ public life
    def plan(self, model: Any, data: Any = None, *, executor: Any = None) -> Plan:
        """Validate everything and say what a run would cost (and, on Ray, how it splits); runs no model."""
        from .executors.config import as_executor
        from .executors.driver import check_executor, shards_of, streams_in_process
        from .executors.shards import IN_MEMORY_PROMPTS

        executor = as_executor(executor)
        with recording_warnings() as warned:
            check_executor(self, model, executor, connect=False)
            prepared = self._prepare(model, data)
            plan = prepared.plan
            if not self.not_sharded_reason():
                plan.global_step = self.global_step(prepared)
                if executor.type == "in_process" and streams_in_process(plan.examples):
                    plan.notes.append(f"more than {IN_MEMORY_PROMPTS} prompts: each batch's per-prompt values are "
                                      "written to a temporary shard folder and merged from there (docs/scale.md)")
            if executor.type == "ray":
                shards = shards_of(self, prepared, executor)
                biggest = sorted((len(s.examples) for s in shards), reverse=True)
                busiest = sum(biggest[i] for i in range(0, len(biggest), executor.workers))
                plan.executor, plan.shards, plan.workers = "ray", len(shards), executor.workers
                passes = plan.forward_passes + plan.backward_passes
                plan.passes_per_worker = -(-passes * busiest // max(1, plan.examples or 1))
                plan.memory_per_worker_bytes = plan.peak_memory_bytes
        plan.notes += [f"warning [{w['code']}]: {w['message']}" + (f" ({w['count']} times)" if w["count"] > 1 else "")
                       for w in warned]
        return plan

    def run(self, model: Any, data: Any = None, *, executor: Any = None, quiet: bool = False,
            shards_dir: str | Path | None = None, resume: bool = False) -> Any:
        """Run over the dataset and return a `Result` (with its manifest).

        executor:   None / es.InProcess() (here), or es.Ray(workers=N, address=..., resources_per_worker=...).
        shards_dir: where finished shards are written as Parquet (the CLI uses RUN/shards); Ray without it
                    writes them to a temporary folder, removed after the merge.
        resume:     skip the shards already in shards_dir (a run interrupted before).
        The model runs in eval mode (dropout off) whatever mode it was in, and is put back after;
        warnings raised on the way are kept in `result.warnings` and the manifest.
        """
        from .executors.config import as_executor
        from .executors.driver import check_executor, run_sharded
        from .results.manifest import build_manifest

        executor = as_executor(executor)
        sharded = not self.not_sharded_reason()
        if (shards_dir is not None or resume) and not sharded:
            raise ConfigError(f"{self.name} does not split into shards, so it has nothing to resume",
                              code="resume_unsupported", remedy="run it again without --resume")
        if resume and shards_dir is None:
            raise ConfigError("resume needs the folder of the interrupted run's shards", code="resume_needs_folder",
                              remedy="pass --out RUN (the CLI keeps shards in RUN/shards), or shards_dir=...")
        info = None
        with recording_warnings() as warned:
            t0 = time.perf_counter()
            spec = check_executor(self, model, executor)
            prepared = self._prepare(model, data)
            t1 = time.perf_counter()
            with prepared.model.evaluating():
                if sharded:
                    result, info = run_sharded(self, prepared, executor, spec, quiet=quiet, shards_dir=shards_dir,
                                               resume=resume)
                else:
                    result = self.execute(prepared, quiet=quiet)
            t2 = time.perf_counter()
        result.plan = prepared.plan
        result.warnings = warned
        result.manifest = build_manifest(self, prepared.model, prepared.data,
                                         {"prepare_s": round(t1 - t0, 4), "run_s": round(t2 - t1, 4)},
                                         warnings=warned)
        if info is not None and (executor.type != "in_process" or shards_dir is not None):
            result.manifest["executor"] = info
            result.shards_dir = None if shards_dir is None else Path(shards_dir)
        return result

    def _prepare(self, model: Any, data: Any) -> Prepared:
        rough = self.stats.rough_intervals()
        if rough:
            warn(rough, code="few_resamples")
        adapter = adapt(model)
        dataset = None
        if data is not None:
            dataset = load_data(data, tokenizer=adapter.tokenizer)
        elif self.needs_data:
            raise ConfigError(f"{self.name} needs data", code="data_missing",
                              remedy="pass data: a task ({task: ioi, n: 16}), a file, or prompts")
        return self.prepare(adapter, dataset)

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared:
        """Every check `execute` relies on, and the plan. Must not run the model."""

    def execute(self, prepared: Prepared, *, quiet: bool = False) -> Any:
        """The batched work; returns a Result. A sharded operation runs its shards here (one shard)."""
        from .executors.config import InProcess
        from .executors.driver import run_sharded

        if self.not_sharded_reason():
            raise NotImplementedError(f"{type(self).__name__} implements neither execute nor execute_shard")
        result, _ = run_sharded(self, prepared, InProcess(), None, quiet=quiet, shards_dir=None, resume=False)
        return result

    # ------------------------------------------------------------------ sharding (docs/scale.md)
    sharded: ClassVar[bool] = False

    def not_sharded_reason(self) -> str:
        """Why this configuration cannot be split into shards ('' if it can)."""
        return "" if self.sharded else "it does not split into shards of prompts"

    def shard_batches(self, prepared: Prepared) -> list[list[int]]:
        """The dataset indices of each length-grouped batch, in the order they run (a shard is some of them)."""
        raise NotImplementedError

    def phases(self, prepared: Prepared) -> tuple[str, ...]:
        """The sharded phases in order; a global step on the driver may sit before each (`before_phase`)."""
        return ("main",)

    def global_step(self, prepared: Prepared) -> str:
        """What runs on the driver between phases, for the plan ('' if nothing)."""
        return ""

    def before_phase(self, prepared: Prepared, phase: str, merged: dict[str, dict[str, Any]]) -> Any:
        """The driver's global step before `phase`, from the merged earlier phases; what it returns reaches
        every shard of the phase as `prepared.state["contexts"][phase]` (keep it small: it travels to workers)."""
        return None

    def execute_shard(self, prepared: Prepared, phase: str, batches: list[int], *, quiet: bool = False) -> Any:
        """The batched work on some batches: a PerPrompt (arrays whose rows follow those batches' examples)."""
        raise NotImplementedError

    def summarise(self, prepared: Prepared, merged: dict[str, dict[str, Any]], *, quiet: bool = False) -> Any:
        """The Result from every phase's merged per-prompt arrays (prompt order)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def choose_batch_size(self, bytes_per_example: int, n_examples: int, cap: int = 64) -> int:
        """batch_size if given, else what the memory budget allows (a sharded operation: enough batches to
        shard, executors.shards.batch_cap)."""
        from .executors.shards import batch_cap

        if self.batch_size is not None:
            return self.batch_size
        budget = int(self.memory_budget_mb * 2**20)
        size = max(1, min(cap, n_examples, budget // max(1, bytes_per_example)))
        return size if self.not_sharded_reason() else batch_cap(size, n_examples)

    def config(self) -> dict[str, Any]:
        """The full config, JSON-ready, with the operation's name."""
        return {"operation": self.name, **self.model_dump(mode="json")}


def model_bytes(model: ModelAdapter) -> int:
    return sum(p.numel() * p.element_size() for p in model.tl.parameters())


def progress(items: Iterable[T], *, total: int | None = None, desc: str = "", quiet: bool = False) -> Iterator[T]:
    """A progress bar over `items` (tqdm), silent when quiet or when stderr is not a terminal."""
    import os
    import sys

    if quiet or os.environ.get("ENTOSCOPE_QUIET") == "1" or not sys.stderr.isatty():
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, total=total, desc=desc, leave=False)
