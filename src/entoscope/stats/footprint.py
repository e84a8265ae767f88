"""The memory a table's statistics take: the bounded chunks of bootstrap.py, resample.py and signflip.py, for a
plan's peak (memory.py). An upper bound: the sign-flip refinement runs only on the cells whose interval
excludes 0, which a plan cannot know; it is counted as if every cell were refined."""

from __future__ import annotations

from typing import Any

from .bootstrap import CELLS_PER_CHUNK
from .resample import WEIGHT_CHUNK
from .signflip import CHUNK_FLOATS, EXACT_MAX
from .sums import BLOCK_FLOATS


def summary_bytes(n: int, cells: int, stats: Any) -> int:
    """Peak bytes of summarising `cells` cells over n prompts with `stats` (Stats): the per-prompt values read in
    blocks, the resampling weights, and the larger of the bootstrap's chunk and the sign-flip test's."""
    n, cells = max(1, n), max(1, cells)
    values = min(n * cells, BLOCK_FLOATS) * 8 * 2
    n_boot = int(getattr(stats, "n_boot", 0) or 0)
    if not n_boot:
        return values
    weights = n_boot * min(n, WEIGHT_CHUNK) * 8 * 2
    boot = min(n_boot * cells, CELLS_PER_CHUNK) * 8 * 3
    flips = signflip_bytes(n, cells) if getattr(stats, "refine_p", False) else 0
    return values + weights + max(boot, flips)


def signflip_bytes(n: int, cells: int) -> int:
    """The sign-flip test's chunk: exact (n <= EXACT_MAX), the two halves' partial sums of a slice of cells,
    sorted, and the searches' indices; Monte Carlo, the patterns, their sums and the running counts."""
    if n <= EXACT_MAX:
        half = 2 ** (n - n // 2)
        per = min(cells, max(1, CHUNK_FLOATS // half))
        return per * half * 8 * 6
    step = max(1, CHUNK_FLOATS // max(n, cells))  # the patterns drawn at once, once grown
    held = min(CHUNK_FLOATS, cells * step)  # their sums per cell: the products and their absolute values
    return min(CHUNK_FLOATS, n * step) * 8 + held * 8 * 2
