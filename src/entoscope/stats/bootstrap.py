"""The bootstrap over prompts, leave-one-out influence and p-values, for any weighted statistic.

A statistic is an object with `n` (prompts), `n_cells` (U) and `__call__(W [K, n], cols) -> [K, U']`
that evaluates the aggregate under prompt weights W (rows of weights; an all-ones row is the plain
aggregate). Resampling prompts with replacement is a row of multinomial counts (Efron & Tibshirani
1993); leaving prompt i out is a row with w_i = 0. So one function gives the value, the bootstrap
distribution and the jackknife values, and no model is ever re-run.

Intervals (`Stats.ci_method`): "bca" (bias-corrected and accelerated, Efron 1987: the quantiles are
moved by the bias z0 = Phi^-1(share of bootstrap values below the estimate) and the acceleration
a = sum d^3 / (6 (sum d^2)^1.5), d the jackknife deviations), "expanded_percentile" (the percentile
interval), both at the small-sample-expanded tail levels (Hesterberg 2015; without the expansion a
95% bootstrap interval of a mean over 50 prompts covers only ~94%, over 20 ~92%), or "percentile"
(the plain alpha/2 and 1 - alpha/2 quantiles). The p-value against 0 inverts the same interval
(stats/levels.py): p < 1 - L exactly when the level-L interval excludes 0; below 1 - ci_level a statistic
of weighted sums with a numerator (means, ratios of means) gets the sign-flip test's p instead
(stats/signflip.py, `Stats.refine_p`), so there the agreement holds at the run's level and every lower one.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..heap import roomy_heap
from .config import Stats
from .levels import expanded_alpha  # noqa: F401 (re-exported: where it always was)
from .levels import bca_level, expands, inverted_p, ndtri, tail_alpha
from .resample import Resampler, resample_weights
from .signflip import refine
from .sums import SumsStat

CELLS_PER_CHUNK = 1 << 23  # bootstrap values held at once (resamples x cells): 64 MiB of float64
# a resample whose value is the estimate's up to float64 rounding is a tie (counted half in BCa's bias share):
# the resamples that draw every prompt once equal the estimate exactly, but a many-row product rounds them
# differently from the one-row estimate, and a share moved by those rounding errors moves the interval by
# much of its width (4 prompts: 24 of 256 resamples). Weighted sums round at ~n 1e-16 of their scale.
TIE_RELATIVE = 1e-10


class StatFn(Protocol):
    n: int
    n_cells: int

    def __call__(self, W: np.ndarray, cols: slice) -> np.ndarray: ...


class FunctionStat:
    """A statistic given as a plain function of the weights (any aggregate; see R2 in probing)."""

    def __init__(self, fn: Callable[[np.ndarray, slice], np.ndarray], n: int, n_cells: int) -> None:
        self.fn, self.n, self.n_cells = fn, n, n_cells

    def __call__(self, W: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        return self.fn(W, cols)


@dataclass
class Summary:
    """Per cell: the value, its interval, standard error, p-value, and its most influential prompt."""

    value: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    se: np.ndarray
    p_value: np.ndarray
    influence: np.ndarray  # max over prompts of |value without that prompt - value|
    influential: np.ndarray  # which prompt (index into the per-prompt table), -1 if none
    level: float
    method: str
    n_boot: int
    boot: np.ndarray | None = None  # [n_boot, U] when kept (circuit stability reuses them)
    p_bound: np.ndarray | None = None  # True where p_value is the resampling's resolution (the true p is smaller)
    p_refined: np.ndarray | None = None  # True where p_value is the sign-flip test's (stats/signflip.py)

    def columns(self, name: str = "value") -> dict[str, Any]:
        """Table columns `<name>`, `<name>_ci_low`, `<name>_ci_high`, `<name>_se`, `<name>_p`,
        `<name>_p_bound`, ..."""
        return {name: self.value, f"{name}_ci_low": self.ci_low, f"{name}_ci_high": self.ci_high,
                f"{name}_se": self.se, f"{name}_p": self.p_value, f"{name}_p_bound": self.bound(),
                f"{name}_influence": self.influence, f"{name}_influential_prompt": self.influential}

    def bound(self) -> np.ndarray:
        """Per cell: whether `p_value` is an upper bound (all False where there is no p)."""
        return self.p_bound if self.p_bound is not None else np.zeros(self.value.shape, dtype=bool)


def leave_one_out(stat: StatFn, cols: slice = slice(None), rows: int = 256) -> np.ndarray:
    """[n, U'] the statistic with each prompt left out in turn."""
    n = stat.n
    out = []
    for lo in range(0, n, rows):
        W = np.ones((min(rows, n - lo), n))
        W[np.arange(W.shape[0]), np.arange(lo, lo + W.shape[0])] = 0.0
        out.append(stat(W, cols))
    return np.concatenate(out) if out else np.empty((0, 0))


def acceleration(jack: np.ndarray) -> np.ndarray:
    """BCa's acceleration a = sum d^3 / (6 (sum d^2)^1.5), d = mean(jack) - jack, from the jackknife values."""
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.nanmean(jack, 0) - jack
        return np.nansum(d ** 3, 0) / (6 * np.nansum(d ** 2, 0) ** 1.5)


def _interval(boot: np.ndarray, value: np.ndarray, accel: np.ndarray | None, level: float, method: str, n: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(low, high, p, p_bound) of each cell from its bootstrap values; accel: BCa's acceleration (None:
    percentile). p is the test inversion of the same interval (stats/levels.py)."""
    alpha = tail_alpha(level, n, method)
    expanded = expands(method, n)
    finite = np.isfinite(boot)
    lo_q = np.full(value.shape, alpha)
    hi_q = np.full(value.shape, 1 - alpha)
    z0 = np.zeros(value.shape)
    a = np.zeros(value.shape)
    if method == "bca" and accel is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            tie = np.abs(boot - value) <= TIE_RELATIVE * np.maximum(np.abs(value), np.nanmax(np.abs(boot), 0))
            below = (boot < value) & ~tie
            share = (np.where(finite, below, False).sum(0) + 0.5 * np.where(finite, tie, False).sum(0)
                     ) / finite.sum(0)
            bias = ndtri(share)
        ok = np.isfinite(bias) & np.isfinite(accel)  # degenerate distributions fall back to percentiles
        z0, a = np.where(ok, bias, 0.0), np.where(ok, accel, 0.0)
        za, zb = ndtri(np.array(alpha)), ndtri(np.array(1 - alpha))
        lo_q = np.where(ok, bca_level(z0, a, za), lo_q)
        hi_q = np.where(ok, bca_level(z0, a, zb), hi_q)
    low, high, p = (np.full(value.shape, np.nan) for _ in range(3))
    bound = np.zeros(value.shape, dtype=bool)
    whole = finite.all(0)  # cells with every resample defined: one sort, quantiles by interpolation
    if whole.any():
        s = np.sort(boot[:, whole], 0)
        low[whole], high[whole] = _quantiles(s, lo_q[whole], hi_q[whole])
        p[whole], bound[whole] = inverted_p(s, z0[whole], a[whole], n, expanded)
    for j in np.flatnonzero(~whole):  # cells undefined on some resamples: their own quantiles
        b = boot[finite[:, j], j]
        if b.size:
            low[j], high[j] = np.quantile(b, [lo_q[j], hi_q[j]])
            pj, bj = inverted_p(np.sort(b)[:, None], z0[j:j + 1], a[j:j + 1], n, expanded)
            p[j], bound[j] = pj[0], bj[0]
    return low, high, p, bound


def _quantiles(sorted_boot: np.ndarray, lo_q: np.ndarray, hi_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column quantiles (numpy's default linear rule) of column-sorted values at per-column levels."""
    n = sorted_boot.shape[0]
    cols = np.arange(sorted_boot.shape[1])

    def at(q: np.ndarray) -> np.ndarray:
        pos = np.clip(q, 0, 1) * (n - 1)
        i = np.floor(pos).astype(int)
        j = np.minimum(i + 1, n - 1)
        return sorted_boot[i, cols] + (pos - i) * (sorted_boot[j, cols] - sorted_boot[i, cols])
    return at(lo_q), at(hi_q)


def summarise(stat: StatFn, stats: Stats, seed: int, *, keep_boot: bool = False) -> Summary:
    """Value, interval, se, p-value and leave-one-out influence of every cell of `stat`.

    A statistic of weighted sums (`SumsStat`: means, ratios of means, CPR/CMD) is read block by block
    in two passes (the sums and every resample's sums; then each prompt left out), so its memory is
    n_boot x cells whatever the number of prompts; any other statistic is evaluated on the whole
    [n_boot, n] weight matrix."""
    big = stat.n_cells * stats.n_boot > CELLS_PER_CHUNK  # its bootstrap runs in chunks: their pages reused
    with warnings.catch_warnings(), roomy_heap() if big else contextlib.nullcontext():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells (undefined statistics) stay NaN
        if isinstance(stat, SumsStat):
            summary = _summarise_sums(stat, stats, seed, keep_boot)
            if stats.refine_p and stat.numerator is not None and summary.p_bound is not None:
                # p below 1 - ci_level: the sign-flip test of the numerator's per-prompt values
                summary.p_value, summary.p_bound, summary.p_refined = refine(
                    summary.p_value, summary.p_bound, stat.tested, stat.n, stat.n_cells, stats.ci_level,
                    stats.fdr, seed)
            return summary
        return _summarise(stat, stats, seed, keep_boot)


def _summarise(stat: StatFn, stats: Stats, seed: int, keep_boot: bool) -> Summary:
    n, U = stat.n, stat.n_cells
    value = stat(np.ones((1, n)))[0] if n else np.full(U, np.nan)
    jack = leave_one_out(stat) if n > 1 else np.full((0, U), np.nan)
    with np.errstate(invalid="ignore"):
        dev = np.abs(jack - value[None]) if jack.size else np.full((0, U), np.nan)
    if dev.shape[0]:
        filled = np.where(np.isfinite(dev), dev, -1.0)
        influential = filled.argmax(0)
        influence = np.where(filled.max(0) >= 0, filled.max(0), np.nan)
        influential = np.where(np.isfinite(influence), influential, -1)
    else:
        influence, influential = np.full(U, np.nan), np.full(U, -1)
    if stats.n_boot == 0 or n < 2:
        return _no_interval(value, influence, influential, stats)
    boot = stat(resample_weights(n, stats.n_boot, seed))
    accel = acceleration(jack) if n >= 3 else None
    return _finish(lambda cols: boot[:, cols], value, accel, influence, influential, stats, n, keep_boot)


def _summarise_sums(stat: SumsStat, stats: Stats, seed: int, keep_boot: bool) -> Summary:
    n, U = stat.n, stat.n_cells
    n_boot = stats.n_boot if n >= 2 else 0
    resampler = Resampler(n, n_boot, seed) if n_boot else None
    total = np.zeros((1, stat.width))
    boot_sums = np.zeros((n_boot, stat.width))
    step = max(1, CELLS_PER_CHUNK // max(1, n_boot))
    for lo, hi, X in stat.blocks():  # pass 1: the sums, and every resample's sums
        total += np.ones((1, hi - lo)) @ X
        if resampler is not None:
            R = resampler.block(lo, hi)
            for c0 in range(0, stat.width, step):  # a slice of columns at a time: no second [n_boot, width]
                boot_sums[:, c0:c0 + step] += R @ X[:, c0:c0 + step]
    value = stat.g(total)[0] if n else np.full(U, np.nan)
    influence, influential = np.full(U, np.nan), np.full(U, -1)
    accel = None
    if n > 1:  # pass 2: each prompt left out, g(total - x_i), as deviations e_i from the value
        k, s1, s2, s3 = (np.zeros(U) for _ in range(4))
        best = np.full(U, -1.0)
        for lo, hi, X in stat.blocks():
            with np.errstate(invalid="ignore", over="ignore"):
                e = stat.g(total - X) - value[None]
            ok = np.isfinite(e)
            e0 = np.where(ok, e, 0.0)
            k += ok.sum(0)
            s1 += e0.sum(0)
            s2 += (e0 ** 2).sum(0)
            s3 += (e0 ** 3).sum(0)
            dev = np.where(ok, np.abs(e0), -1.0)
            better = dev.max(0) > best
            influential = np.where(better, lo + dev.argmax(0), influential)
            best = np.where(better, dev.max(0), best)
        influence = np.where(best >= 0, best, np.nan)
        influential = np.where(best >= 0, influential, -1)
        if n >= 3:  # sum (m - e)^2 and sum (m - e)^3 with m the mean deviation: BCa's acceleration
            with np.errstate(invalid="ignore", divide="ignore"):
                m = s1 / k
                d2 = np.maximum(s2 - k * m ** 2, 0.0)
                d3 = k * m ** 3 - 3 * m ** 2 * s1 + 3 * m * s2 - s3
                accel = d3 / (6 * d2 ** 1.5)
    if not n_boot:
        return _no_interval(value, influence, influential, stats)
    return _finish(lambda cols: stat.g(boot_sums, cols), value, accel, influence, influential, stats, n, keep_boot)


def _no_interval(value: np.ndarray, influence: np.ndarray, influential: np.ndarray, stats: Stats) -> Summary:
    nan = np.full(value.shape, np.nan)
    return Summary(value, nan.copy(), nan.copy(), nan.copy(), nan.copy(), influence, influential,
                   stats.ci_level, stats.ci_method, 0, p_bound=np.zeros(value.shape, dtype=bool))


def _finish(boot: Callable[[slice], np.ndarray], value: np.ndarray, accel: np.ndarray | None, influence: np.ndarray,
            influential: np.ndarray, stats: Stats, n: int, keep_boot: bool) -> Summary:
    """Intervals, standard errors and p-values from the bootstrap values, boot(cols) -> [n_boot, cells in cols]
    (made a slice of cells at a time: CELLS_PER_CHUNK values)."""
    U = value.shape[0]
    low, high, se, p = (np.full(U, np.nan) for _ in range(4))
    bound = np.zeros(U, dtype=bool)
    kept = np.empty((stats.n_boot, U)) if keep_boot else None
    step = max(1, CELLS_PER_CHUNK // max(1, stats.n_boot))
    for c0 in range(0, U, step):
        cols = slice(c0, min(U, c0 + step))
        b = boot(cols)
        if kept is not None:
            kept[:, cols] = b
        low[cols], high[cols], p[cols], bound[cols] = _interval(
            b, value[cols], None if accel is None else accel[cols], stats.ci_level, stats.ci_method, n)
        with np.errstate(invalid="ignore"):
            se[cols] = (b.std(0, ddof=1) if np.isfinite(b).all() else np.nanstd(b, 0, ddof=1)) \
                if stats.n_boot > 1 else np.nan
    undefined = ~np.isfinite(value)  # no value: no interval either
    low[undefined], high[undefined], p[undefined], bound[undefined] = np.nan, np.nan, np.nan, False
    return Summary(value, low, high, se, p, influence, influential, stats.ci_level, stats.ci_method,
                   stats.n_boot, kept, bound)


def fragile(summary: Summary, share: float) -> np.ndarray:
    """Cells one prompt carries: leaving it out moves the value by more than `share` of
    max(|value|, 10% of the largest |value| in the table)."""
    scale = np.nanmax(np.abs(summary.value)) if np.isfinite(summary.value).any() else 0.0
    floor = np.maximum(np.abs(summary.value), 0.1 * scale)
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(summary.influence), summary.influence > share * floor, False)
