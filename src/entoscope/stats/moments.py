"""Descriptive moments per column (count, mean, standard deviation), read in blocks of prompts.

Blocks are combined with Chan, Golub & LeVeque's pairwise update (1979): each block's mean and sum of
squared deviations, merged exactly, so the result is as accurate as a two-pass computation and needs
one block in memory. NaN entries are left out of their column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .sums import block_rows


@dataclass
class Moments:
    count: np.ndarray  # [width] finite entries
    mean: np.ndarray  # NaN where count is 0
    m2: np.ndarray  # sum of squared deviations from the mean

    @property
    def std(self) -> np.ndarray:
        """Population standard deviation (ddof 0), NaN where a column has no entry."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, np.sqrt(self.m2 / self.count), np.nan)


def column_moments(n: int, width: int, read: Callable[[int, int], np.ndarray]) -> Moments:
    """Count, mean and spread of each column of values read(lo, hi) -> [hi - lo, width], over n prompts."""
    count, mean, m2 = np.zeros(width), np.zeros(width), np.zeros(width)
    rows = block_rows(width)
    for lo in range(0, n, rows):
        v = np.asarray(read(lo, min(n, lo + rows)), dtype=np.float64).reshape(-1, width)
        ok = np.isfinite(v)
        nb = ok.sum(0).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            mb = np.where(nb > 0, np.where(ok, v, 0.0).sum(0) / nb, 0.0)
            m2b = np.where(ok, (v - mb) ** 2, 0.0).sum(0)
            total = count + nb
            delta = mb - mean
            mean = np.where(total > 0, mean + delta * np.where(total > 0, nb / total, 0.0), 0.0)
            m2 = m2 + m2b + np.where(total > 0, delta ** 2 * count * nb / np.where(total > 0, total, 1.0), 0.0)
        count = total
    return Moments(count, np.where(count > 0, mean, np.nan), m2)
