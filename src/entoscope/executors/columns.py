"""One phase's merged per-prompt arrays, read in blocks of prompts: in memory, or streamed from the shards.

`PromptColumns` is what `summarise` receives for each phase: arrays whose first axis runs over the
dataset's prompts in prompt order, read by range (`read(lo, hi, keys)`), plus the shards' sums.
Summaries, per-prompt tables and pages read them block by block (stats.SumsStat, results.LazyTable),
so no consumer needs every prompt at once; `columns[key]` still hands one whole array (small ones:
a metric per prompt).

- `MemoryColumns`: a run in one process, its one shard's arrays put in prompt order.
- `StoredColumns`: a run whose shards are Parquet files (Ray, or a run with a shard folder). The
  shards are length-grouped batches, so prompt order interleaves them; one pass over the shard files
  (one shard in memory at a time) distributes their rows into buckets of consecutive prompts (Arrow
  files in a temporary folder, removed with the object), and a read loads the buckets it spans.
  Each shard file is verified as that pass reads it (store.open_shard: its seal, checksums and
  identity), so a file changed since `--resume` verified it is refused (`shard_changed`), never merged.
  Memory: one shard, or one bucket (<= 64 MiB of rows), whatever the number of prompts.

Both hand the same arrays for the same range, and consumers choose their blocks from the arrays'
widths alone, so an in-process run and a sharded run compute the same numbers bit for bit.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckFailedError
from .shards import PerPrompt, Shard

BUCKET_BYTES = 64 * 2**20  # rows of one bucket file, at most (and at most WEIGHT_CHUNK prompts)


class PromptColumns(ABC):
    """Per-prompt arrays of one phase, in prompt order, read by range; and the shards' sums."""

    n: int
    sums: dict[str, np.ndarray]

    @abstractmethod
    def keys(self) -> list[str]:
        """The per-prompt arrays' names."""

    @abstractmethod
    def read(self, lo: int, hi: int, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Rows lo..hi-1 (prompt order) of the named arrays (all by default)."""

    def __getitem__(self, key: str) -> np.ndarray:
        """A whole array (or a sum): for arrays with a few values per prompt."""
        if key in self.sums:
            return self.sums[key]
        return self.read(0, self.n, [key])[key]

    def __contains__(self, key: object) -> bool:
        return key in self.sums or key in self.keys()


class MemoryColumns(PromptColumns):
    def __init__(self, arrays: dict[str, np.ndarray], sums: dict[str, np.ndarray], n: int) -> None:
        self.arrays, self.sums, self.n = arrays, sums, n

    def keys(self) -> list[str]:
        return list(self.arrays)

    def read(self, lo: int, hi: int, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        return {k: self.arrays[k][lo:hi] for k in (self.keys() if keys is None else keys)}


def check_cover(examples: Sequence[np.ndarray], n: int) -> None:
    """Every prompt exactly once over the parts, or `shards_incomplete`."""
    flat = np.concatenate(list(examples)) if len(examples) else np.zeros(0, np.int64)
    counts = np.bincount(flat, minlength=n) if len(flat) else np.zeros(n, int)
    if len(counts) > n or (counts != 1).any():
        missing = np.flatnonzero(counts[:n] == 0)[:5].tolist()
        twice = np.flatnonzero(counts > 1)[:5].tolist()
        raise CheckFailedError(f"the shards do not cover the prompts exactly once (missing {missing}, more than "
                               f"once {twice})", code="shards_incomplete",
                               remedy="rerun without --resume (the shard folder may hold another run's files)")


def add_sums(parts: Sequence[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
    """The parts' sums added key by key, in the parts' order."""
    total: dict[str, np.ndarray] = {}
    for sums in parts:
        for key, value in (sums or {}).items():
            total[key] = value if key not in total else total[key] + value
    return total


class StoredColumns(PromptColumns):
    """A phase's per-prompt arrays streamed from its shard files (see the module docstring)."""

    def __init__(self, paths: Sequence[Path], shards: Sequence[Shard], n: int,
                 expect: Sequence[dict[str, Any]] | None = None) -> None:
        """`expect`: each file's identity (ShardStore.identity); every file is verified again as it is read
        (its seal and checksums, and its identity where given), so what is merged is what was verified."""
        self.paths, self.n = list(paths), n
        self._expect = list(expect) if expect is not None else [None] * len(self.paths)
        check_cover([self._examples(p) for p in self.paths], n)
        first = self._open(0)[0] if self.paths else None
        self._keys = [c for c in first.column_names if c != "example"] if first is not None else []
        row_bytes = max(1, first.nbytes // max(1, first.num_rows)) if first is not None else 1
        del first
        from ..stats.resample import WEIGHT_CHUNK

        self.bucket = WEIGHT_CHUNK
        while self.bucket > 1 and self.bucket * row_bytes > BUCKET_BYTES:
            self.bucket //= 2
        self._loaded: tuple[int, dict[str, np.ndarray]] | None = None
        # now: the shard files may be removed once the phase is merged
        self._folder, self.sums = self._distribute()

    def _open(self, i: int) -> tuple[Any, dict[str, np.ndarray] | None]:
        from .store import ShardDamaged, ShardStale, changed, open_shard

        try:
            return open_shard(self.paths[i], self._expect[i])
        except (ShardDamaged, ShardStale) as err:
            raise changed(self.paths[i], err) from None

    @staticmethod
    def _examples(path: Path) -> np.ndarray:
        import pyarrow.parquet as pq

        from .store import ShardDamaged, changed

        try:
            return pq.read_table(path, columns=["example"]).column("example").to_numpy()
        except Exception as err:  # noqa: BLE001 - unreadable now, though it was verified
            raise changed(path, ShardDamaged(f"{type(err).__name__}: {err}")) from None

    def keys(self) -> list[str]:
        return list(self._keys)

    def _distribute(self) -> tuple[Path, dict[str, np.ndarray]]:
        """One pass over the shard files (each verified as it is read): each shard's rows appended to the
        buckets of their prompts; the shards' sums added in shard order."""
        import pyarrow as pa

        folder = Path(tempfile.mkdtemp(prefix="entoscope-merge-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        writers: dict[int, Any] = {}
        sums = []
        try:
            for i in range(len(self.paths)):
                table, shard_sums = self._open(i)
                sums.append(shard_sums)
                table = table.replace_schema_metadata({b"entoscope": table.schema.metadata[b"entoscope"]})
                bucket_of = table.column("example").to_numpy() // self.bucket
                for b in np.unique(bucket_of):
                    piece = table.take(pa.array(np.flatnonzero(bucket_of == b)))
                    if b not in writers:
                        writers[b] = pa.ipc.new_file(folder / f"bucket-{b:06d}.arrow", table.schema)
                    writers[b].write_table(piece)
        finally:
            for w in writers.values():
                w.close()
        return folder, add_sums(sums)

    def _bucket(self, b: int) -> dict[str, np.ndarray]:
        if self._loaded is not None and self._loaded[0] == b:
            return self._loaded[1]
        import pyarrow as pa

        from .store import from_arrow

        with pa.memory_map(str(self._folder / f"bucket-{b:06d}.arrow")) as source:
            part = from_arrow(pa.ipc.open_file(source).read_all())
        order = np.argsort(part.examples, kind="stable")
        arrays = {k: v[order] for k, v in part.arrays.items()}
        self._loaded = (b, arrays)
        return arrays

    def read(self, lo: int, hi: int, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        keys = self.keys() if keys is None else list(keys)
        if hi <= lo:
            return {k: self._empty(k) for k in keys}
        pieces: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        for b in range(lo // self.bucket, -(-hi // self.bucket)):
            arrays = self._bucket(b)
            start = b * self.bucket
            sl = slice(max(lo, start) - start, min(hi, start + self.bucket) - start)
            for k in keys:
                pieces[k].append(arrays[k][sl])
        return {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in pieces.items()}

    def _empty(self, key: str) -> np.ndarray:
        return self.read(0, min(1, self.n), [key])[key][:0] if self.n else np.zeros(0)


def merge(parts: Sequence[PerPrompt], n_examples: int) -> MemoryColumns:
    """The parts' arrays over all examples, in prompt order (every example exactly once), their sums added."""
    check_cover([p.examples for p in parts], n_examples)
    if not parts:
        return MemoryColumns({}, {}, n_examples)
    examples = np.concatenate([p.examples for p in parts])
    order = np.argsort(examples, kind="stable")
    arrays = {key: (parts[0].arrays[key] if len(parts) == 1 else np.concatenate([p.arrays[key] for p in parts]))[order]
              for key in parts[0].arrays}
    return MemoryColumns(arrays, add_sums([p.sums for p in parts]), n_examples)
