"""The few sites that matter most in each prompt: top-k rows of a per-prompt table.

Over a wide dictionary (hundreds of features x positions x layers), a dense per-prompt grid is mostly
near-zero rows; `top_sites` keeps, for each prompt, the k sites with the largest |value| (ties broken
by site order), so a result over every feature reads as "which features carried this prompt".
"""

from __future__ import annotations

import itertools

import pandas as pd

from ..errors import ConfigError
from ..results.result import Result


def top_sites(result: Result, k: int = 10, column: str = "difference") -> pd.DataFrame:
    """Rows of `result.per_prompt` with the k largest |column| per example, largest first (read block by
    block: the whole per-prompt table is never built)."""
    blocks = result.per_prompt_blocks()
    first = next(blocks, None)
    if first is None or column not in first.columns:
        raise ConfigError(f"this result has no per-prompt column {column!r}", code="top_sites_column",
                          remedy="run with per_prompt: true and pick one of its columns (difference, normalized, ...)")
    if k < 1:
        raise ConfigError(f"k={k} keeps nothing", code="top_sites_column", remedy="k >= 1")
    tops = [_top(table, k, column) for table in itertools.chain([first], blocks)]
    return tops[0] if len(tops) == 1 else pd.concat(tops, ignore_index=True)


def _top(table: pd.DataFrame, k: int, column: str) -> pd.DataFrame:
    order = table.assign(_size=table[column].abs()).sort_values(["example", "_size"], ascending=[True, False],
                                                                kind="stable")
    return order.groupby("example", sort=False).head(k).drop(columns="_size").reset_index(drop=True)
