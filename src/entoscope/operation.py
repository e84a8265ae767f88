"""The one life every operation follows: validate -> plan -> run (batched) -> Result.

An operation is a pydantic model: its fields ARE its config, so Python, YAML and the command line
are three spellings of one object, and `model_dump()` in the manifest re-runs exactly.
Subclasses implement `prepare` (every check `run` needs, plus the plan; runs no model) and
`execute` (the batched work). `plan()` calls only `prepare`, so a plan that says OK has already
passed every check on names, shapes and lengths that `run` makes.

An operation that splits into shards of prompts (docs/scale.md) takes the `Sharded` mixin
(executors/contract.py: the sharding contract) and implements, instead of `execute`: `execute_shard`
(per-prompt arrays of some batches), optionally `shard_batches` / `phases` / `before_phase` (a global
step on the driver between sharded phases), and `summarise` (the Result from the merged per-prompt
arrays). Its `execute` is then "one shard, here"; `run(..., executor=es.Ray(...))` runs the same shards
on Ray workers. `Plan` and `Prepared` (what `prepare` returns) live in prepared.py.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .config_model import ConfigModel
from .data.examples import Dataset
from .data.loading import load_data
from .errors import ConfigError, recording_warnings, warn
from .executors.contract import Sharded
from .heap import steady_heap
from .models.adapter import ModelAdapter, adapt
from .prepared import Plan, Prepared
from .registry import register
from .confirm import Confirm
from .stats import Stats

T = TypeVar("T")


def register_operation(cls: type[T]) -> type[T]:
    """Class decorator: make an operation reachable by its `name` from YAML and the CLI."""
    return register("operation", cls.name)(cls)  # type: ignore[attr-defined]


class Operation(ConfigModel):
    """Base class of every operation (lens, patching, probing, circuits, ...)."""

    name: ClassVar[str] = "operation"
    needs_data: ClassVar[bool] = True
    tests_cells: ClassVar[bool] = False  # its table tests every row against 0 (p, q, significant): the plan's screen
    text_fields: ClassVar[tuple[str, ...]] = ()  # fields the command line takes as written, not as YAML (prompts)

    batch_size: int | None = Field(default=None, ge=1, description="prompts per forward pass; default: "
                                   "the largest that keeps the run within memory")
    memory: int | str = Field(default="auto", description="memory the run may take above the loaded model: a size "
                              "(12GB, 512MiB, bytes) or auto (90% of what the model's device has free); batches and "
                              "chunks are sized to it, and a run that cannot fit is refused before any forward "
                              "(memory_budget)")
    memory_budget_mb: float | None = Field(default=None, gt=0, description="deprecated: the memory budget in MiB "
                                           "(read as memory: <N>MiB); use memory")
    prepend_bos: bool = Field(default=True, description="prepend the BOS token to text prompts")
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="seed of every random choice the operation makes")
    stats: Stats = Field(default_factory=Stats, description="intervals and robust aggregation over prompts "
                         "(n_boot, ci_level, ci_method, degenerate_share, influence_share, fdr, refine_p)")
    confirm: Confirm | None = Field(default=None, description="re-test the screen's top k cells on n fresh prompts "
                                    "of the same task ({k: 10, n: 32}; tables tested against 0 only)")
    _screen_cells: int | None = PrivateAttr(default=None)  # a confirmation run: its k cells are what BH counts
    _budget: int | None = PrivateAttr(default=None)  # memory resolved to bytes by prepare_for (memory.py)

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_size(cls, value: Any) -> Any:
        from .memory import AUTO, parse_size

        size = parse_size(value)  # a value that is not a size is refused here
        if size is None:
            return AUTO
        return value.strip() if isinstance(value, str) else size

    @model_validator(mode="after")
    def _memory_alias(self) -> Operation:
        """memory_budget_mb (before memory existed; saved manifests hold it) read as memory in MiB."""
        mb = self.memory_budget_mb
        if mb is None:
            return self
        from .memory import parse_size

        given = int(mb * 2**20)
        if self.memory != "auto" and parse_size(self.memory) != given:
            raise ConfigError(f"memory {self.memory!r} and memory_budget_mb {mb:g} disagree",
                              code="config_invalid", remedy="give memory only (memory_budget_mb is its old name)")
        object.__setattr__(self, "memory", given)
        object.__setattr__(self, "memory_budget_mb", None)
        return self

    # ------------------------------------------------------------------ public life
    def plan(self, model: Any, data: Any = None, *, executor: Any = None) -> Plan:
        """Validate everything and say what a run would cost (and, on Ray, how it splits); runs no model."""
        from .executors.config import as_executor
        from .executors.driver import check_executor, shards_of, streams_in_process
        from .executors.shards import IN_MEMORY_PROMPTS

        executor = as_executor(executor)
        with recording_warnings() as warned:
            check_executor(self.name, self.not_sharded_reason(), model, executor, connect=False)
            fresh = self._confirm_data(data)
            prepared = self.prepare_for(model, data)
            prepared.model.check_unembedding()  # what run checks on its first forward (a no-op once made)
            plan = prepared.plan
            if fresh is not None:
                self._plan_confirmation(plan, prepared, fresh)
            sharding = self.sharding()
            if sharding is not None:
                plan.global_step = sharding.global_step(prepared)
                if executor.type == "in_process" and streams_in_process(plan.examples):
                    plan.notes.append(f"more than {IN_MEMORY_PROMPTS} prompts: each batch's per-prompt values are "
                                      "written to a temporary shard folder and merged from there (docs/scale.md)")
            if executor.type == "ray":
                assert sharding is not None  # check_executor refused it otherwise
                shards = shards_of(sharding, prepared, executor)
                biggest = sorted((len(s.examples) for s in shards), reverse=True)
                busiest = sum(biggest[i] for i in range(0, len(biggest), executor.workers))
                plan.executor, plan.shards, plan.workers = "ray", len(shards), executor.workers
                passes = plan.forward_passes + plan.backward_passes
                plan.passes_per_worker = -(-passes * busiest // max(1, plan.examples or 1))
                plan.memory_per_worker_bytes = plan.model_bytes + plan.peak_memory_bytes
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
        sharding = self.sharding()
        if (shards_dir is not None or resume) and sharding is None:
            raise ConfigError(f"{self.name} does not split into shards, so it has nothing to resume",
                              code="resume_unsupported", remedy="run it again without --resume")
        if resume and shards_dir is None:
            raise ConfigError("resume needs the folder of the interrupted run's shards", code="resume_needs_folder",
                              remedy="pass --out RUN (the CLI keeps shards in RUN/shards), or shards_dir=...")
        fresh = self._confirm_data(data)
        info = None
        with recording_warnings() as warned:
            t0 = time.perf_counter()
            spec = check_executor(self.name, self.not_sharded_reason(), model, executor)
            prepared = self.prepare_for(model, data)
            chosen = None if fresh is None else self._fresh_prompts(prepared, fresh)  # before the screen runs
            t1 = time.perf_counter()
            with prepared.model.evaluating():
                if sharding is not None:
                    if executor.type != "in_process" and self.memory == "auto":  # every worker sizes as the driver did
                        sharding = self.model_copy(update={"memory": self._budget})
                    result, info = run_sharded(sharding, prepared, executor, spec, quiet=quiet,
                                               shards_dir=shards_dir, resume=resume)
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
        if fresh is not None:
            assert chosen is not None
            self._confirm(result, model, fresh, chosen, executor, quiet)
        return result

    def _confirm_data(self, data: Any) -> dict[str, Any] | None:
        """The confirmation's fresh data (confirm.py), or None without `confirm`; refused before any work."""
        from .confirm import check_testable, fresh_data

        if self.confirm is None:
            return None
        if not self.tests_cells:
            raise ConfigError(f"{self.name} tests nothing against 0, so it has no cells to confirm",
                              code="confirm_unsupported", remedy="leave confirm out")
        check_testable(self.stats, self.name)
        return fresh_data(data, self.confirm, self.name)

    def _fresh_prompts(self, prepared: Prepared[Any], fresh: dict[str, Any]) -> tuple[Dataset, dict[str, Any]]:
        """The confirmation's prompts: none of the screen's, none twice (confirm.fresh_prompts)."""
        from .confirm import fresh_prompts

        return fresh_prompts(fresh, prepared.data, prepared.model.tokenizer, self.name)

    def _plan_confirmation(self, plan: Plan, prepared: Prepared[Any], fresh: dict[str, Any]) -> None:
        """Count the confirmation run into the plan: the operation it will run (`confirm_plan_rows` stand for the
        k cells the screen will choose) prepared on the fresh prompts, its passes added to the screen's."""
        assert self.confirm is not None
        data, record = self._fresh_prompts(prepared, fresh)
        rows = self.confirm_plan_rows(prepared)
        op = self.confirm_subset(rows)
        op._screen_cells = self.confirm.k
        again = op.prepare_for(prepared.model, data).plan
        plan.forward_passes += again.forward_passes
        plan.backward_passes += again.backward_passes
        plan.notes.append(f"confirm: the screen's top {self.confirm.k} cells again on {record['prompts']} fresh prompts "
                          f"(none of the screen's, none repeated): {again.forward_passes} forward and "
                          f"{again.backward_passes} backward passes, counted in the totals above"
                          + (f" (for the first {self.confirm.k} cells of the grid: the screen chooses which)"
                             if rows is not None else ""))

    def _confirm(self, result: Any, model: Any, fresh: dict[str, Any], chosen: tuple[Dataset, dict[str, Any]],
                 executor: Any, quiet: bool) -> None:
        """The screen's top k cells run again on fresh prompts (through the same executor); both stages in
        `result.confirmation` (confirmation.csv and a section of the page)."""
        from .confirm import confirmation_note, confirmation_table, top_rows

        assert self.confirm is not None
        data, record = chosen
        top = top_rows(result.table, self.confirm.k)
        op = self.confirm_subset(top)
        op._screen_cells = len(top)  # its plan's screen: the k cells the confirmation tests, not the grid it runs
        again = op.run(model, data, executor=executor, quiet=quiet)
        result.confirmation = confirmation_table(result.table, again.table, self.confirm.k, self.stats.fdr,
                                                 result.plan.examples, again.plan.examples)
        result.notes.append(("confirmation on fresh prompts", confirmation_note(result.confirmation, self.stats.fdr)))
        result.manifest["confirmation"] = {"data": fresh, "k": self.confirm.k, "fresh_prompts": record,
                                           "records": (again.manifest.get("data") or {}).get("records"),
                                           "warnings": again.warnings, "timings": again.manifest.get("timings")}

    def confirm_subset(self, rows: Any) -> Operation:
        """This operation for the confirmation run: by default the same grid (its top rows are read); an
        operation whose cost grows with its cells returns one restricted to `rows` (patching)."""
        return self.model_copy(update={"confirm": None})

    def confirm_plan_rows(self, prepared: Prepared[Any]) -> Any:
        """Rows standing, in the plan, for the k cells the screen will choose (what `confirm_subset` restricts
        to); None where the confirmation runs the whole grid whatever it chooses (the default)."""
        return None

    def prepare_for(self, model: Any, data: Any) -> Prepared[Any]:
        """`prepare` on what the user passed: the model adapted (`adapt`) and the data loaded (`load_data`).
        `plan` and `run` start here, and so does each Ray worker, on its own replica of the model."""
        steady_heap()  # a run's resident peak follows its live tensors (heap.py)
        rough = self.stats.rough_intervals()
        if rough:
            warn(rough, code="few_resamples")
        adapter = adapt(model)
        self._budget = self.memory_budget(adapter)
        dataset = None
        if data is not None:
            dataset = load_data(data, tokenizer=adapter.tokenizer)
        elif self.needs_data:
            raise ConfigError(f"{self.name} needs data", code="data_missing",
                              remedy="pass data: a task ({task: ioi, n: 16}), a file, or prompts")
        prepared = self.prepare(adapter, dataset)
        if prepared.plan.peak_memory_bytes > self._budget:  # sizes at their smallest and still over: refused
            self._refuse_budget(adapter, dataset, prepared.plan.peak_memory_bytes)
        prepared.plan.memory_budget_bytes = self._budget
        prepared.plan.model_bytes = model_bytes(adapter)
        if self.tests_cells:
            screen_plan(prepared.plan, self.stats, cells=self._screen_cells,
                        confirm_k=None if self.confirm is None else self.confirm.k)
        return prepared

    def calibrate(self, model: Any, data: Any = None, *, executor: Any = None) -> Plan:
        """`plan`, with its time estimated from one calibration forward (calibration.py: the model passes the
        plan counts); what `entoscope ... --plan` prints. Unlike `plan`, it runs the model once (twice with a
        backward)."""
        from .calibration import calibrate_plan

        return calibrate_plan(self.plan(model, data, executor=executor), model, data, self.prepend_bos)

    def _refuse_budget(self, adapter: ModelAdapter, dataset: Dataset | None, need: int) -> None:
        """Refuse a plan whose peak exceeds the budget (memory_budget), naming the smallest budget that would do:
        the peak of the plan prepared with every size at its smallest (a budget of one byte)."""
        from .memory import MemoryBudgetError, refuse

        budget, smallest = self._budget or 0, need
        tiny = self.model_copy(update={"memory": 1, "batch_size": None})
        tiny._budget = 1
        try:
            smallest = min(need, tiny.prepare(adapter, dataset).plan.peak_memory_bytes)
        except MemoryBudgetError as err:
            smallest = min(need, err.smallest)
        refuse(self.name, smallest, budget, "its smallest batches")

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[Any]:
        """Every check `execute` relies on, and the plan. Must not run the model."""

    def execute(self, prepared: Prepared[Any], *, quiet: bool = False) -> Any:
        """The batched work; returns a Result. A sharded operation's (`Sharded.execute`) runs its shards here."""
        raise NotImplementedError(f"{type(self).__name__} implements neither execute nor the sharding contract "
                                  "(executors/contract.py)")

    # ------------------------------------------------------------------ sharding (docs/scale.md)
    def not_sharded_reason(self) -> str:
        """Why this configuration cannot be split into shards ('' if it can; `Sharded` says '')."""
        return "it does not split into shards of prompts"

    def sharding(self) -> Sharded | None:
        """This operation as its sharding contract, or None when this configuration runs unsharded."""
        return self if isinstance(self, Sharded) and not self.not_sharded_reason() else None

    # ------------------------------------------------------------------ helpers for subclasses
    def memory_budget(self, model: ModelAdapter) -> int:
        """This run's budget in bytes (memory.py): `memory` as given, or what the model's device has free."""
        from .memory import resolve

        return resolve(self.memory, model.device)

    @property
    def budget_bytes(self) -> int:
        """The budget prepare_for resolved (a prepare called directly resolves it on the CPU's free memory)."""
        if self._budget is None:
            from .memory import resolve

            self._budget = resolve(self.memory)
        return self._budget

    def choose_batch_size(self, bytes_per_example: int, n_examples: int, cap: int = 64, *, fixed: int = 0,
                          peak_of: Callable[[int], int] | None = None, unit: str = "prompt") -> int:
        """batch_size if given (refused when its estimate exceeds the budget), else the largest batch whose
        estimated peak, `peak_of(rows)` (default fixed + rows x bytes_per_example), stays within the memory
        budget (memory.fit_rows; refused with the smallest budget when one row does not fit); a sharded
        operation's is cut to give enough batches to shard (executors.shards.batch_cap)."""
        from .executors.shards import batch_cap
        from .memory import check_within, fit_rows

        peak = peak_of or (lambda rows: fixed + rows * bytes_per_example)
        if self.batch_size is not None:
            check_within(self.name, peak(self.batch_size), self.budget_bytes, f"batch_size {self.batch_size}")
            return self.batch_size
        size = fit_rows(peak, self.budget_bytes, min(cap, max(1, n_examples)), what=self.name, unit=unit)
        return size if self.not_sharded_reason() else batch_cap(size, n_examples)

    def config(self) -> dict[str, Any]:
        """The full config, JSON-ready, with the operation's name."""
        return {"operation": self.name, **self.model_dump(mode="json")}


def screen_plan(plan: Plan, stats: Stats, *, cells: int | None = None, confirm_k: int | None = None) -> None:
    """What the table's screen can show at its number of prompts (stats/signflip.py): the smallest p and q
    into the plan, and one `screen_blind` warning, before the run, when no cell can be a discovery on its own
    (saying how many cells at the smallest p Benjamini-Hochberg would need, or that none could be one at all).
    cells: the cells Benjamini-Hochberg counts (a confirmation run: its k); default the plan's rows.
    confirm_k: the run confirms its top k on fresh prompts (the warning says what that confirmation needs)."""
    from .stats.signflip import screen_limits, screen_text

    m = cells or plan.rows
    if not stats.n_boot or plan.examples < 2 or m < 1:
        return
    limits = screen_limits(plan.examples, m, stats.fdr, n_boot=stats.n_boot, method=stats.ci_method,
                           refine_p=stats.refine_p)
    plan.screen = limits
    plan.notes.append(screen_text(limits))
    if limits["blind"]:
        need, together = limits["min_prompts"], limits["cells_together"]
        warn(f"{m:,} cells over {plan.examples} prompts: the smallest p is {limits['min_p']:.2g} and a cell "
             f"needs p <= {limits['needed_p']:.2g} to be a discovery on its own (Benjamini-Hochberg at fdr "
             f"{stats.fdr:g}), so none can on its own"
             + (f" (only {together:,} or more cells at the smallest p together could be)" if together is not None
                else " and none can at all")
             + "; "
             + (f"use {need} prompts or more" if need else "no number of prompts reaches it with refine_p false")
             + (f"; the confirmation of the top {confirm_k} on fresh prompts needs p <= "
                f"{stats.fdr / confirm_k:.2g} there" if confirm_k else
                ", or confirm the top cells on fresh prompts (confirm: {k: 10})"), code="screen_blind")


def model_bytes(model: ModelAdapter) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def progress(items: Iterable[T], *, total: int | None = None, desc: str = "", quiet: bool = False) -> Iterator[T]:
    """A progress bar over `items` (tqdm), silent when quiet or when stderr is not a terminal."""
    import os
    import sys

    if quiet or os.environ.get("ENTOSCOPE_QUIET") == "1" or not sys.stderr.isatty():
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, total=total, desc=desc, leave=False)
