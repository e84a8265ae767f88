"""Per-prompt tables and arrays a Result hands out on demand, made from the merged per-prompt arrays.

A per-prompt table has a row per prompt and site (patching: 100,000 pairs x 180 sites is 18 million
rows), so a Result keeps the recipe, not the rows: `LazyTable` makes the rows of a range of prompts
(`make(lo, hi)`), and `Result.save` writes per_prompt.csv / .parquet block by block. Reading
`result.per_prompt` builds the whole DataFrame then (the user asked for it); pages take the first
prompts only (`head`). `LazyDict` does the same for arrays in `result.extra`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

BLOCK_ROWS = 1 << 16  # table rows made at once (prompts x rows per prompt)


class LazyTable:
    """A table of `n` prompts' rows, made `block` prompts at a time by make(lo, hi) (rows in prompt order)."""

    def __init__(self, n: int, make: Callable[[int, int], pd.DataFrame], rows_per_prompt: int = 1) -> None:
        self.n, self.make = n, make
        self.block = max(1, BLOCK_ROWS // max(1, rows_per_prompt))

    def blocks(self) -> Iterator[pd.DataFrame]:
        for lo in range(0, self.n, self.block):
            yield self.make(lo, min(self.n, lo + self.block))

    def head(self, prompts: int) -> pd.DataFrame:
        """The rows of the first `prompts` prompts."""
        return self.make(0, min(self.n, prompts))

    def to_pandas(self) -> pd.DataFrame:
        frames = list(self.blocks())
        if not frames:
            return self.make(0, 0)
        return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)

    def write(self, folder: Path, name: str, safe: Callable[[pd.DataFrame], pd.DataFrame]) -> list[str]:
        """`name`.csv and `name`.parquet, written block by block (the same files as the whole frame's)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        schema = None
        try:
            for i, frame in enumerate(self.blocks() if self.n else [self.make(0, 0)]):
                frame.to_csv(folder / f"{name}.csv", index=False, header=i == 0, mode="w" if i == 0 else "a")
                table = pa.Table.from_pandas(safe(frame), preserve_index=False, schema=schema)
                if writer is None:
                    schema = table.schema
                    writer = pq.ParquetWriter(folder / f"{name}.parquet", schema)
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
        return [f"{name}.csv", f"{name}.parquet"]


class LazyDict(dict):
    """A dict some of whose values are made on first access (then kept) by a function of no arguments.

    Keys, `in` and len() count the lazy values without making them; values() and items() make them."""

    def __init__(self, values: dict[str, Any], lazy: dict[str, Callable[[], Any]]) -> None:
        super().__init__(values)
        self._lazy = {k: v for k, v in lazy.items() if k not in values}

    def __missing__(self, key: str) -> Any:
        if key in self._lazy:
            value = self._lazy.pop(key)()
            self[key] = value
            return value
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or key in self._lazy

    def __iter__(self) -> Iterator[str]:
        yield from list(super().keys()) + list(self._lazy)

    def __len__(self) -> int:
        return super().__len__() + len(self._lazy)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def keys(self) -> Any:  # type: ignore[override]
        return list(self)

    def values(self) -> Any:  # type: ignore[override]
        return [self[k] for k in list(self)]

    def items(self) -> Any:  # type: ignore[override]
        return [(k, self[k]) for k in list(self)]
