"""The one life every operation follows: validate -> plan -> run (batched) -> Result.

An operation is a pydantic model: its fields ARE its config, so Python, YAML and the command line
are three spellings of one object, and `model_dump()` in the manifest re-runs exactly.
Subclasses implement `prepare` (every check `run` needs, plus the plan; runs no model) and
`execute` (the batched work). `plan()` calls only `prepare`, so a plan that says OK has already
passed every check on names, shapes and lengths that `run` makes.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import Field

from .config_model import ConfigModel
from .data.examples import Dataset
from .data.loading import load_data
from .errors import ConfigError, recording_warnings
from .models.adapter import ModelAdapter, adapt
from .registry import register
from .stats import Stats

T = TypeVar("T")


@dataclass
class Plan:
    """What a run will cost, worked out without running the model."""

    operation: str
    rows: int
    forward_passes: int
    backward_passes: int
    batch_sizes: list[int]
    peak_memory_bytes: int
    files: list[str] = field(default_factory=lambda: ["table.csv", "table.parquet", "index.html", "manifest.json"])
    notes: list[str] = field(default_factory=list)
    examples: int = 0

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
    seed: int = Field(default=0, description="seed of every random choice the operation makes")
    stats: Stats = Field(default_factory=Stats, description="intervals and robust aggregation over prompts "
                         "(n_boot, ci_level, ci_method, degenerate_share, influence_share, fdr)")

    # ------------------------------------------------------------------ public life
    def plan(self, model: Any, data: Any = None) -> Plan:
        """Validate everything and say what a run would cost; runs no model."""
        with recording_warnings() as warned:
            plan = self._prepare(model, data).plan
        plan.notes += [f"warning [{w['code']}]: {w['message']}" for w in warned]
        return plan

    def run(self, model: Any, data: Any = None, *, quiet: bool = False) -> Any:
        """Run over the dataset and return a `Result` (with its manifest).

        The model runs in eval mode (dropout off) whatever mode it was in, and is put back after;
        warnings raised on the way are kept in `result.warnings` and the manifest.
        """
        from .results.manifest import build_manifest

        with recording_warnings() as warned:
            t0 = time.perf_counter()
            prepared = self._prepare(model, data)
            t1 = time.perf_counter()
            with prepared.model.evaluating():
                result = self.execute(prepared, quiet=quiet)
            t2 = time.perf_counter()
        result.plan = prepared.plan
        result.warnings = warned
        result.manifest = build_manifest(self, prepared.model, prepared.data,
                                         {"prepare_s": round(t1 - t0, 4), "run_s": round(t2 - t1, 4)},
                                         warnings=warned)
        return result

    def _prepare(self, model: Any, data: Any) -> Prepared:
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

    @abstractmethod
    def execute(self, prepared: Prepared, *, quiet: bool = False) -> Any:
        """The batched work; returns a Result."""

    # ------------------------------------------------------------------ helpers for subclasses
    def choose_batch_size(self, bytes_per_example: int, n_examples: int, cap: int = 64) -> int:
        if self.batch_size is not None:
            return self.batch_size
        budget = int(self.memory_budget_mb * 2**20)
        return max(1, min(cap, n_examples, budget // max(1, bytes_per_example)))

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
