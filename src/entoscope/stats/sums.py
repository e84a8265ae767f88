"""Statistics of weighted column sums, read in blocks of prompts: the ones a dataset of any size can summarise.

Nearly every aggregate entoscope reports is g(w @ X): a function of weighted sums over prompts of a
few per-prompt columns X [n, K]. A mean is sum(w x) / sum(w); a ratio of means is sum(w a) / sum(w b);
MIB's CPR and CMD are trapezoids of such ratios. For these the bootstrap needs only the sums under
each resample's counts (accumulated block by block: [n_boot, K], whatever n is), and leaving prompt i
out is g(total - x_i), exact and O(n K) instead of n re-evaluations. So X is never needed whole:
`read(lo, hi)` hands the rows of prompts lo..hi-1, from memory or from the shards on disk
(executors/columns.py), and in-process and sharded runs read the same blocks, so they sum in the
same order and agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .resample import WEIGHT_CHUNK

BLOCK_FLOATS = 1 << 20  # per-prompt values read at once: 8 MiB of float64


def block_rows(width: int) -> int:
    """Prompts per block: a power of two (so blocks never straddle a weight chunk) with rows x width
    <= BLOCK_FLOATS; it depends on the width only, never on where the values are stored."""
    rows = WEIGHT_CHUNK
    while rows > 1 and rows * width > BLOCK_FLOATS:
        rows //= 2
    return rows


Reader = Callable[[int, int], np.ndarray]


class SumsStat:
    """theta(w) = g(w @ X, cols) per cell, with X [n, width] read in blocks by read(lo, hi).

    g(S [m, width], cols) -> [m, cells in cols]; the statistic has n_cells cells. numerator: where each
    cell is 0 exactly when one column of weighted sums is (a mean, a ratio of means: column u for cell u),
    that column's index per cell; the sign-flip test (stats/signflip.py) flips its per-prompt values."""

    def __init__(self, n: int, n_cells: int, width: int, read: Reader,
                 g: Callable[[np.ndarray, slice], np.ndarray], numerator: np.ndarray | None = None) -> None:
        self.n, self.n_cells, self.width = n, n_cells, width
        self._read, self.g = read, g
        self.rows = block_rows(width)
        self.numerator = numerator

    def tested(self, cells: np.ndarray) -> np.ndarray:
        """[n, len(cells)]: the per-prompt values of the cells' numerator columns (their sum is 0 exactly
        when the cell is)."""
        if self.numerator is None:
            raise ValueError("this statistic has no numerator column to test")
        out = np.empty((self.n, len(cells)))
        for lo, hi, X in self.blocks():
            out[lo:hi] = X[:, self.numerator[cells]]
        return out

    def blocks(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(lo, hi, X[lo:hi] as float64) for consecutive blocks of prompts."""
        for lo in range(0, self.n, self.rows):
            hi = min(self.n, lo + self.rows)
            X = np.asarray(self._read(lo, hi), dtype=np.float64)
            if X.shape != (hi - lo, self.width):
                raise ValueError(f"a block of prompts {lo}..{hi} has shape {X.shape}, expected {(hi - lo, self.width)}")
            yield lo, hi, X

    def sums(self, W: np.ndarray) -> np.ndarray:
        """[K, width]: W [K, n] @ X, block by block."""
        S = np.zeros((W.shape[0], self.width))
        for lo, hi, X in self.blocks():
            S += W[:, lo:hi] @ X
        return S

    def __call__(self, W: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        return self.g(self.sums(W), cols)


def _ratio(U: int, shared: bool) -> Callable[[np.ndarray, slice], np.ndarray]:
    def g(S: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        a = S[:, :U][:, cols]
        d = S[:, U:] if shared else S[:, U:][:, cols]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(d != 0, a / np.where(d != 0, d, 1.0), np.nan)
    return g


class RatioStat(SumsStat):
    """theta(w) = (w @ num) / (w @ den) per cell. num [n, U]; den [n, U] or [n] (shared by the cells).

    Covers a mean (num = values, den = 1), a mean over the finite entries (num = values with NaN as 0,
    den = 1 where finite), and a ratio of means ((mean a - mean b) / (mean c - mean b): num = a - b,
    den = c - b). A cell whose weighted denominator is 0 is NaN for that weight row.
    """

    def __init__(self, num: np.ndarray, den: np.ndarray) -> None:
        num = np.asarray(num, dtype=np.float64)
        num = num[:, None] if num.ndim == 1 else num
        den = np.asarray(den, dtype=np.float64)
        den = den[:, None] if den.ndim == 1 else den
        X = np.concatenate([num, den], axis=1)
        n, U = num.shape
        super().__init__(n, U, X.shape[1], lambda lo, hi: X[lo:hi], _ratio(U, den.shape[1] == 1), np.arange(U))

    @classmethod
    def streamed(cls, n: int, n_cells: int, read: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
                 shared_den: bool) -> SumsStat:
        """A ratio whose (num [rows, U], den [rows, U or 1]) come from read(lo, hi), block by block."""
        width = n_cells + (1 if shared_den else n_cells)

        def read_x(lo: int, hi: int) -> np.ndarray:
            num, den = read(lo, hi)
            den = np.asarray(den, dtype=np.float64)
            return np.concatenate([np.asarray(num, dtype=np.float64), den[:, None] if den.ndim == 1 else den], 1)
        return SumsStat(n, n_cells, width, read_x, _ratio(n_cells, shared_den), np.arange(n_cells))


def mean_stat(values: np.ndarray) -> RatioStat:
    """The mean over prompts of each column of values [n, U], skipping NaN entries."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[:, None]
    ok = np.isfinite(v)
    if ok.all():  # one shared denominator: half the sums
        return RatioStat(v, np.ones(v.shape[0]))
    return RatioStat(np.where(ok, v, 0.0), ok.astype(np.float64))


def streamed_mean(n: int, n_cells: int, read: Reader, *, skip_nan: bool = True) -> SumsStat:
    """The mean over prompts of values read block by block (read(lo, hi) -> [rows, n_cells]).

    skip_nan: a NaN entry is left out of its cell's mean (a per-cell count); False: the values are all
    finite by construction (one shared count; a NaN would make its cell NaN)."""
    def read_num_den(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        v = np.asarray(read(lo, hi), dtype=np.float64).reshape(hi - lo, n_cells)
        if not skip_nan:
            return v, np.ones(hi - lo)
        ok = np.isfinite(v)
        return np.where(ok, v, 0.0), ok.astype(np.float64)
    return RatioStat.streamed(n, n_cells, read_num_den, shared_den=not skip_nan)


def ratio_stat(num: np.ndarray, den: np.ndarray) -> RatioStat:
    return RatioStat(num, den)
