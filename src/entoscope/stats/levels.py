"""The tail levels of a bootstrap interval, and their inversion: the p-value that agrees with the interval.

An interval at level L takes two quantiles of the bootstrap values, at levels beta_lo and beta_hi
made from the one-sided tail alpha = (1 - L) / 2 by, in turn:

- the small-sample expansion (methods "bca" and "expanded_percentile"; Hesterberg 2015): the tail's
  normal quantile z = Phi^-1(alpha) becomes f(z) = sqrt(n / (n-1)) t_{n-1}(z) (its quantile under a
  t distribution with n - 1 degrees of freedom, scaled up by the plug-in variance's (n-1)/n);
- BCa's adjustment (method "bca"; Efron 1987): beta = Phi(z0 + h(z0 + f(z))) with h(u) = u / (1 - a u),
  z0 the bias and a the acceleration. Past the pole of h (1 - a u <= 0) the level is the extreme one
  (0 or 1): h keeps rising to +inf (a > 0) or falling to -inf (a < 0), so beta is monotone in the tail
  (the plain formula wraps around there and gives an upper endpoint below the lower one).

The p-value against 0 is the test inversion of that interval (Efron & Tibshirani 1993, section 15.4;
DiCiccio & Efron 1996, "Bootstrap confidence intervals", section 7): the smallest 1 - L at which the
interval at level L excludes 0. Every step above is monotone in the tail, so it inverts exactly: find
the level beta* where the (linearly interpolated) bootstrap quantile crosses 0, undo h, then the
expansion. So, with the same resamples, p < 1 - L exactly when the level-L interval excludes 0.

Resolution: B resamples cannot place a crossing below level 1 / (B + 1), so p is never reported
below the p of such a crossing (`p_floor`: 2 / (B + 1) for the plain percentile, wider with the
expansion; the interval without bias correction, so one floor per table) and is flagged as a bound
there. For every level with 1 - L above the floor the agreement with the interval stays exact.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Method = Literal["bca", "expanded_percentile", "percentile"]
METHODS: tuple[str, ...] = ("bca", "expanded_percentile", "percentile")


def ndtri(p: np.ndarray) -> np.ndarray:
    return torch.special.ndtri(torch.as_tensor(p, dtype=torch.float64)).numpy()


def ndtr(x: np.ndarray) -> np.ndarray:
    return torch.special.ndtr(torch.as_tensor(x, dtype=torch.float64)).numpy()


def t_quantile(z: np.ndarray | float, dof: int | np.ndarray) -> np.ndarray | float:
    """Student's t quantile from the normal one (Cornish-Fisher expansion; within 1e-3 for dof >= 5)."""
    v = np.asarray(dof, dtype=float) if np.ndim(dof) else float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def expands(method: str, n: int) -> bool:
    """Whether `method` widens its tails for n prompts (the expansion is off below 6 prompts)."""
    return method != "percentile" and n >= 6


def tail_alpha(level: float, n: int, method: str) -> float:
    """The one-sided tail probability the interval's quantile levels start from."""
    alpha = (1 - level) / 2
    if not expands(method, n):
        return alpha
    z = float(ndtri(np.array(alpha)))
    return float(ndtr(np.array(np.sqrt(n / (n - 1)) * t_quantile(z, n - 1))))


def expanded_alpha(level: float, n: int) -> float:
    """The tail probability whose normal quantile is sqrt(n / (n-1)) t_{n-1}: the percentile bootstrap's
    small-sample expansion (Hesterberg 2015), which corrects the too-narrow bootstrap of a mean (its
    variance is the plug-in s^2 (n-1)/n, and the t distribution's tails are heavier)."""
    return tail_alpha(level, n, "expanded_percentile")


def _unexpand(zt: np.ndarray, n: int) -> np.ndarray:
    """The nominal tail quantile z <= 0 with sqrt(n / (n-1)) t_{n-1}(z) = zt, by bisection (the map is
    increasing and below the identity for z <= 0, so z lies in [zt, 0])."""
    v = float(n - 1)
    c = np.sqrt(n / (n - 1))
    # t_quantile's polynomial by powers of z (odd): z (k1 + z^2 (k3 + z^2 (k5 + z^2 k7)))
    k1 = 1 + 1 / (4 * v) + 3 / (96 * v**2) - 15 / (384 * v**3)
    k3 = 1 / (4 * v) + 16 / (96 * v**2) + 17 / (384 * v**3)
    k5 = 5 / (96 * v**2) + 19 / (384 * v**3)
    k7 = 3 / (384 * v**3)
    lo, hi = zt.copy(), np.zeros_like(zt)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        m2 = mid * mid
        below = c * mid * (k1 + m2 * (k3 + m2 * (k5 + m2 * k7))) < zt
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def bca_level(z0: np.ndarray, a: np.ndarray, z: np.ndarray | float) -> np.ndarray:
    """BCa's quantile level Phi(z0 + h(z0 + z)), h(u) = u / (1 - a u), the extreme level past h's pole."""
    u = z0 + z
    den = 1 - a * u
    with np.errstate(invalid="ignore", divide="ignore"):
        h = np.where(den > 0, u / np.where(den > 0, den, 1.0), np.sign(u) * np.inf)
    return ndtr(z0 + h)


def _pole_inverse(w: np.ndarray, a: np.ndarray, upper: bool) -> np.ndarray:
    """u* with h(u) > w exactly for u > u* (upper False), or v* with h(v) < w exactly for v < v* (True)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        den = 1 + a * w
        inside = np.where(den > 0, w / np.where(den > 0, den, 1.0), np.nan)
        # w outside the range of h: beyond -1/a on the side a points away from
        beyond = np.where(a > 0, -np.inf, np.inf)
        out = np.where(den > 0, inside, beyond)
        edge = np.isinf(w) & (w > 0 if upper else w < 0)  # beta* at 0 or 1: only past the pole
        at_pole = np.where(a != 0, 1 / np.where(a != 0, a, 1.0), np.nan)
        if upper:
            limit = np.where(a > 0, at_pole, np.inf)
        else:
            limit = np.where(a < 0, at_pole, -np.inf)
        return np.where(edge, limit, out)


def _crossing(sorted_boot: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The level at which the linearly interpolated quantile of column-sorted values crosses 0, given
    `count` values on the low side of 0 (1 <= count <= B - 1): between the values count-1 and count."""
    B = sorted_boot.shape[0]
    cols = np.arange(sorted_boot.shape[1])
    i = np.clip(count - 1, 0, B - 2)
    lo, hi = sorted_boot[i, cols], sorted_boot[i + 1, cols]
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(hi > lo, -lo / np.where(hi > lo, hi - lo, 1.0), 0.0)
    return (i + t) / (B - 1)


def _tail_of(beta: np.ndarray, z0: np.ndarray, a: np.ndarray, upper: bool) -> np.ndarray:
    """The tail quantile z_t above which the interval's endpoint is beyond 0, for a crossing at beta."""
    w = ndtri(beta) - z0
    if upper:  # high < 0 when h(z0 - z_t) < w
        return z0 - _pole_inverse(w, a, upper=True)
    return _pole_inverse(w, a, upper=False) - z0  # low > 0 when h(z0 + z_t) > w


def _p_of_tail(zt: np.ndarray, n: int, expanded: bool) -> np.ndarray:
    """Two-sided p = 2 Phi(z) of the nominal tail z whose interval has its endpoint at 0."""
    finite = np.isfinite(zt) & (zt < 0)
    z = np.where(finite, zt, -1.0)
    if expanded:
        z = _unexpand(z, n)
    return np.where(zt >= 0, 1.0, np.where(finite, np.minimum(1.0, 2 * ndtr(z)), 0.0))


def p_floor(n_boot: int, n: int, expanded: bool) -> float:
    """The smallest p the resamples resolve: the p of a crossing at level 1 / (B + 1) of the interval
    without bias correction (2 / (B + 1) for the plain percentile; wider with the expansion)."""
    zt = ndtri(np.array([1.0 / (n_boot + 1)]))
    return float(_p_of_tail(zt, n, expanded)[0])


def inverted_p(sorted_boot: np.ndarray, z0: np.ndarray, a: np.ndarray, n: int, expanded: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """(p, bound) per column of column-sorted bootstrap values [B, m] (all finite), given each cell's BCa
    bias z0 and acceleration a (0 and 0: the percentile interval). p is the smallest 1 - L at which the
    level-L interval excludes 0, held at `p_floor` where it is smaller; bound marks those cells (the
    resamples say only p <= the floor)."""
    B, m = sorted_boot.shape
    if B < 2:
        return np.full(m, np.nan), np.zeros(m, dtype=bool)
    below_or_at = (sorted_boot <= 0).sum(0)  # the low endpoint is above 0 from the crossing on
    below = (sorted_boot < 0).sum(0)  # the high endpoint is below 0 up to the crossing
    with np.errstate(invalid="ignore", divide="ignore"):
        zt_low = _tail_of(_crossing(sorted_boot, below_or_at), z0, a, upper=False)
        zt_high = _tail_of(_crossing(sorted_boot, below), z0, a, upper=True)
    zt_low = np.where(below_or_at == 0, -np.inf, np.where(below_or_at == B, np.inf, zt_low))
    zt_high = np.where(below == B, -np.inf, np.where(below == 0, np.inf, zt_high))
    p = _p_of_tail(np.minimum(zt_low, zt_high), n, expanded)  # the side the interval leaves 0 on first
    floor = p_floor(B, n, expanded)
    bound = p < floor
    return np.where(bound, floor, p), bound
