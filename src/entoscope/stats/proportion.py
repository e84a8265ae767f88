"""The Wilson score interval of a share of prompts (Wilson 1927; Brown, Cai & DasGupta 2001).

A share k/n of prompts (IFR's `in_route`, the lens's `target_top1`, feature DLA's `active_share`)
resampled by the bootstrap has a degenerate interval at 0 and n:
every resample of 4 prompts of which 4 qualify also has 4 of 4, so the interval would read [100%, 100%]
and say the next prompt surely qualifies. The Wilson interval inverts the binomial score test instead: at
k = n it is [n / (n + z^2), 1], which at n = 4 and 95% is [0.51, 1], and its coverage stays near the
nominal level at small n, where the Wald interval p +- z sqrt(p(1-p)/n) does not (Brown et al. 2001).
"""

from __future__ import annotations

import numpy as np

from .levels import ndtri


def wilson_interval(successes: np.ndarray, n: np.ndarray | int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided Wilson score interval of successes / n at `level` (0.95: z = 1.96), elementwise (`n` a
    count or an array of counts, broadcast).

    low, high = (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = successes / n; the
    set of proportions pi whose score test |p - pi| / sqrt(pi(1-pi)/n) <= z. NaN where n is 0.

    Its ends are exact where the algebra says so: the lower end at 0 successes is 0 (the written formula,
    centre - half, cancels two equal numbers and leaves a rounding error such as 3.5e-18) and the upper end
    at n of n is 1; the upper end is computed as 1 - the lower end of the failures, so that
    high(k, n) = 1 - low(n - k, n) holds exactly, as it does for the interval itself."""
    k = np.asarray(successes, dtype=np.float64)
    n_arr = np.broadcast_to(np.asarray(n, dtype=np.float64), k.shape)
    z = float(ndtri(np.array(0.5 + level / 2)))
    low, high = _wilson_low(k, n_arr, z), 1.0 - _wilson_low(n_arr - k, n_arr, z)
    empty = ~(n_arr > 0)
    return np.where(empty, np.nan, low), np.where(empty, np.nan, high)


def _wilson_low(k: np.ndarray, n: np.ndarray, z: float) -> np.ndarray:
    """The Wilson interval's lower end at k successes of n, exactly 0 at k <= 0 (and clipped to [0, 1])."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(np.clip(p * (1 - p), 0, None) / n + z * z / (4 * n * n))
    return np.where(k <= 0, 0.0, np.clip(centre - half, 0.0, 1.0))


def share_interval(share: np.ndarray, n: np.ndarray | int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The Wilson interval of shares of prompts (`share` = k / n, the mean of a 0/1 value over n prompts)."""
    share = np.asarray(share, dtype=np.float64)
    return wilson_interval(np.rint(share * np.asarray(n, dtype=np.float64)), n, level)
