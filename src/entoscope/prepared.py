"""What `prepare` makes: the Plan (what a run will cost) and Prepared (what `execute`, or each shard, receives).

`Prepared.state` is the operation's own record of what its `prepare` resolved (a small dataclass per
operation: `LensState`, `PatchingState`, ...), so `execute` and the sharding hooks read attributes, not
string keys. `Prepared.contexts` holds, for a sharded run, what the driver's global step before each phase
returned (executors/contract.py); it is filled by the driver and by each Ray worker, never by `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .data.examples import Dataset
    from .models.adapter import ModelAdapter

S = TypeVar("S")


@dataclass
class Plan:
    """What a run will cost, worked out without running the model.

    peak_memory_bytes: the run's peak above the loaded model (its batches, caches, vocabulary-sized tensors,
    statistics: what `memory` budgets; memory.py), estimated; model_bytes: the loaded model's weights.
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
    screen: dict[str, Any] | None = None  # what a table tested against 0 can show (stats/signflip.screen_limits)
    memory_budget_bytes: int | None = None  # the budget the sizes were chosen in (memory.py)
    model_bytes: int = 0  # the loaded model's weights (not in peak_memory_bytes)
    seconds: float | None = None  # the run's time, estimated from a calibration forward (Operation.calibrate)
    calibration: str = ""  # what the time estimate was calibrated on

    def __str__(self) -> str:
        sizes = sorted(set(self.batch_sizes))
        lines = [
            f"plan: {self.operation}",
            f"  examples          {self.examples}",
            f"  rows              {self.rows}",
            f"  forward passes    {self.forward_passes} (batched: {len(self.batch_sizes)} batches of "
            f"{', '.join(map(str, sizes)) or '-'})",
            f"  backward passes   {self.backward_passes}",
            f"  peak memory       ~{self.peak_memory_bytes / 2**20:.1f} MiB above the loaded model (estimate)"
            + (f"; budget {self.memory_budget_bytes / 2**20:,.0f} MiB" if self.memory_budget_bytes else ""),
            f"  model weights     {self.model_bytes / 2**20:,.1f} MiB",
            f"  files             {', '.join(self.files)}",
        ]
        if self.executor != "in-process":
            memory = (self.memory_per_worker_bytes or 0) / 2**20
            lines += [f"  executor          {self.executor}: {self.shards} shards over {self.workers} workers",
                      f"  passes/worker     ~{self.passes_per_worker} (the busiest worker, forward + backward)",
                      f"  memory/worker     ~{memory:.1f} MiB (its replica and its batches)"]
        if self.seconds is not None:
            lines.append(f"  time              ~{_duration(self.seconds)} (estimate: {self.calibration})")
        if self.global_step:
            lines.append(f"  on the driver     {self.global_step}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class Prepared(Generic[S]):
    """What `prepare` hands to `execute`: the adapter, the data, the plan and what the operation resolved.

    state:    the operation's typed record (every check passed, every size chosen; no model has run).
    contexts: phase -> what the driver's global step before that phase returned (a sharded run only)."""

    model: ModelAdapter
    data: Dataset | None
    plan: Plan
    state: S
    contexts: dict[str, Any] = field(default_factory=dict)
