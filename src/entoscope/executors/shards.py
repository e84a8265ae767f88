"""Shards of prompts and the per-prompt intermediate that shards return and merge into.

A shard is a list of whole length-grouped batches (so each batch is padded and run exactly as in
one process); in-process is one shard of every batch. A shard's result is a `PerPrompt`: named arrays
whose first axis runs over the shard's examples, and optionally sums over its prompts (added across
shards: a mean distribution over the vocabulary need not be kept per prompt). `columns.merge` and
`columns.StoredColumns` put the parts back in prompt order and refuse a prompt that is missing or
appears twice, so a merged sharded run holds exactly the rows of an in-process run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckFailedError

TARGET_BATCHES = 16  # a sharded operation cuts a dataset into at least this many batches when it can ...
MIN_BATCH = 8  # ... of at least this many prompts (memory and an explicit batch_size come first)
IN_MEMORY_PROMPTS = 4096  # a bigger in-process run streams its shards through a temporary folder (driver.py)


def batch_cap(size: int, n_examples: int) -> int:
    """A batch size chosen from memory, capped so that the dataset makes enough batches to shard.

    The cap depends on the dataset only, never on the executor: in-process and Ray runs use the same
    batches, so they compute the same numbers bit for bit (a prompt's rounding depends on its batch's
    padded shape)."""
    return max(1, min(size, max(MIN_BATCH, -(-n_examples // TARGET_BATCHES))))


@dataclass(frozen=True)
class Shard:
    id: int
    batches: tuple[int, ...]  # indices into the operation's batch list
    examples: tuple[int, ...]  # dataset indices of those batches, in batch order


def plan_shards(batch_examples: Sequence[Sequence[int]], shard_size: int | None = None,
                one: bool = False) -> list[Shard]:
    """Group whole batches into shards of at least `shard_size` prompts (default: one batch per shard).

    The plan does not depend on the number of workers, so a run may resume on another cluster.
    one=True: a single shard of every batch (in-process)."""
    if one or not batch_examples:
        return [Shard(0, tuple(range(len(batch_examples))), tuple(i for b in batch_examples for i in b))]
    size = shard_size or 1
    shards: list[Shard] = []
    current: list[int] = []
    count = 0
    for bi, b in enumerate(batch_examples):
        current.append(bi)
        count += len(b)
        if count >= size:
            shards.append(_shard(len(shards), current, batch_examples))
            current, count = [], 0
    if current:
        shards.append(_shard(len(shards), current, batch_examples))
    return shards


def _shard(sid: int, batches: list[int], batch_examples: Sequence[Sequence[int]]) -> Shard:
    return Shard(sid, tuple(batches), tuple(i for bi in batches for i in batch_examples[bi]))


@dataclass
class PerPrompt:
    """Per-prompt arrays of some examples: every array's first axis follows `examples`."""

    examples: np.ndarray  # [n] int64 dataset indices
    arrays: dict[str, np.ndarray]
    sums: dict[str, np.ndarray] | None = None  # totals over the shard's prompts (merged by adding)

    def __post_init__(self) -> None:
        self.examples = np.asarray(self.examples, dtype=np.int64)
        for key, value in self.arrays.items():
            if len(value) != len(self.examples):
                raise CheckFailedError(f"per-prompt array {key!r} has {len(value)} rows for {len(self.examples)} "
                                       "examples", code="shard_rows_mismatch",
                                       remedy="this is a bug in the operation's execute_shard; report it")


def as_numpy(value: Any) -> np.ndarray:
    """A tensor or array as a numpy array on the CPU (dtype kept)."""
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def digest(value: Any) -> str:
    """A stable hash of nested dicts/lists of numbers, strings, arrays and tensors (shard plans, contexts); a
    dataclass hashes as the dict of its fields (a phase context keeps the digest its dict had), leaving out a
    field added later at its default None (so a context written before it was added keeps its digest)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:16]


def _feed(h: Any, value: Any) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                 if not (f.default is None and getattr(value, f.name) is None)}
    if isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            _feed(h, str(k))
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif hasattr(value, "detach") or isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(as_numpy(value))
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(arr.tobytes() if arr.dtype != object else repr(arr.tolist()).encode())
    elif value is None or isinstance(value, (bool, int, float, str, np.generic)):
        h.update(repr(value).encode())
    else:
        h.update(repr(value).encode())
