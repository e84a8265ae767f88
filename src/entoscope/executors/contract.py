"""The sharding contract: the hooks a sharded operation states, and what passes between them.

A dataset operation that splits into shards of prompts (docs/scale.md) is an `Operation` with the
`Sharded` mixin (`class Lens(Sharded, Operation)`). What travels from one step to the next:

    op.prepare_for(model, data)              -> Prepared[S]  every check and the plan; S is the operation's
                                                             typed state (LensState, PatchingState, ...)
    op.shard_batches(prepared)               -> [[example, ...], ...]  its length-grouped batches, in run order;
                                                             a shard is some whole batches (executors/shards.py)
    op.phases(prepared)                      -> ("main",)    or more, when a global step splits the work
    op.before_phase(prepared, phase, merged) -> context      the driver's global step before `phase`, from the
                                                             merged earlier phases; every shard of the phase
                                                             reads it as prepared.contexts[phase]
    op.execute_shard(prepared, phase, batches) -> PerPrompt  per-prompt arrays (and sums) of those batches
    merge (executors/columns.py, the driver's)  -> {phase: PromptColumns}  in prompt order, each prompt once
    op.summarise(prepared, merged)           -> Result       the table and its intervals, read block by block

`executors/driver.py` runs these steps here or hands the shards to Ray workers (`executors/ray_pool.py`),
which call `prepare_for` on their own replica of the model and must find the same batches. The context
travels to every worker and its digest is recorded with each shard file, so it should stay small.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..prepared import Prepared
from .shards import PerPrompt

if TYPE_CHECKING:
    from ..data.tokenized import Batch
    from ..results.result import Result
    from .columns import PromptColumns


class BatchedState(Protocol):
    """A state that keeps its length-grouped batches (what `Sharded.shard_batches` reads by default)."""

    batches: Sequence[Batch]


class Sharded(ABC):
    """The sharding hooks of an operation (a mixin: put it before `Operation` in the bases).

    An operation with it runs through `executors/driver.py`: its `execute` is one shard of every batch,
    here. It implements `execute_shard` and `summarise`; the other hooks have defaults (one phase, no
    global step, the state's `batches` as the shards' batches)."""

    if TYPE_CHECKING:  # given by Operation
        name: ClassVar[str]

        def prepare_for(self, model: Any, data: Any) -> Prepared[Any]: ...

        def config(self) -> dict[str, Any]: ...

    def not_sharded_reason(self) -> str:
        """Why this configuration cannot be split into shards ('' if it can)."""
        return ""

    def shard_batches(self, prepared: Prepared[BatchedState]) -> list[list[int]]:
        """The dataset indices of each length-grouped batch, in the order they run (a shard is some of them)."""
        return [list(b.index) for b in prepared.state.batches]

    def phases(self, prepared: Prepared[Any]) -> tuple[str, ...]:
        """The sharded phases in order; a global step on the driver may sit before each (`before_phase`)."""
        return ("main",)

    def global_step(self, prepared: Prepared[Any]) -> str:
        """What runs on the driver between phases, for the plan ('' if nothing)."""
        return ""

    def before_phase(self, prepared: Prepared[Any], phase: str, merged: Mapping[str, PromptColumns]) -> Any:
        """The driver's global step before `phase`, from the merged earlier phases; what it returns reaches
        every shard of the phase as `prepared.contexts[phase]` (keep it small: it travels to workers)."""
        return None

    @abstractmethod
    def execute_shard(self, prepared: Prepared[Any], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        """The batched work on some batches: a PerPrompt (arrays whose rows follow those batches' examples)."""

    @abstractmethod
    def summarise(self, prepared: Prepared[Any], merged: Mapping[str, PromptColumns], *,
                  quiet: bool = False) -> Result:
        """The Result from every phase's merged per-prompt arrays (prompt order)."""

    def execute(self, prepared: Prepared[Any], *, quiet: bool = False) -> Result:
        """Every shard here, in one process (Operation.run passes an executor to run them elsewhere)."""
        from .config import InProcess
        from .driver import run_sharded

        result, _ = run_sharded(self, prepared, InProcess(), None, quiet=quiet, shards_dir=None, resume=False)
        return result
