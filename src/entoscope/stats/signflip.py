"""The sign-flip (permutation) test of per-prompt values against 0: p-values the data, not the resamples, limit.

The bootstrap interval's inversion (stats/levels.py) cannot place p below its floor, 2 / (B + 1) widened by
the small-sample expansion (0.0091 at 16 prompts, 1,000 resamples), so Benjamini-Hochberg over a big grid
(270 heads need p near 0.05 / 270 = 1.9e-4 for a first discovery) could never discover anything. Where a
cell's p sits at that floor, `refine` replaces it with the sign-flip test's p (Fisher 1935, ch. 21; the
randomisation test of a paired/one-sample mean, Good 2005, "Permutation, Parametric and Bootstrap Tests of
Hypotheses", ch. 3):

- the tested values x_i are, per prompt, the numerator of the statistic (a mean: the value itself; a
  ratio of means sum a / sum b: a_i, since the ratio is 0 exactly when sum a is; a mean skipping NaN:
  0 for a skipped prompt, which no flip changes);
- the null hypothesis is that each x_i is symmetric about 0 (independent prompts): then every one of the
  2^n sign patterns s is as likely as the data's, and p = #{s: |sum s_i x_i| >= |sum x_i|} / 2^n is
  exact. Its smallest value is 2 / 2^n = 2^-(n-1) (the data's pattern and its negation): 3.1e-5 at 16
  prompts, 0.0078 at 8. No test that assumes less can go lower on n prompts;
- for n <= EXACT_MAX the 2^n sums are counted exactly (meet in the middle: the two halves' 2^(n/2)
  partial sums, one sorted, counted against the other by binary search); above, by Monte Carlo over
  `flips` random sign patterns, p = (1 + #{exceeding}) / (flips + 1) (valid: P(p <= a) <= a; Davison &
  Hinkley 1997, ch. 4), flagged as a bound where no pattern exceeded (the exact p may be smaller).

A |sum| within TIE_RELATIVE of the data's (relative to sum |x_i|) counts as exceeding it: float rounding
never makes p smaller than the exact count. Values skewed with mean 0 are not in the null (the test
rejects asymmetry as well as a shifted centre): docs/statistics.md gives the measured rates.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .levels import ndtri, t_quantile

EXACT_MAX = 24  # prompts up to which all 2^n sign patterns are counted (2 x 2^12 partial sums per cell)
MIN_FLIPS = 20_000  # Monte Carlo sign patterns at least ...
MAX_FLIPS = 1_000_000  # ... and at most
FLIPS_PER_DISCOVERY = 10  # flips: enough that a p at fdr / m has ~10 exceeding patterns (~30% relative error)
TIE_RELATIVE = 1e-9
CHUNK_FLOATS = 1 << 22  # partial sums or flipped sums held at once (32 MiB of float64)
STOP_AFTER = 20  # exceeding patterns after which a Monte Carlo cell stops (Besag & Clifford 1991)
SEED_KEY = 0x5F11  # the Monte Carlo stream: SeedSequence([seed, SEED_KEY]), apart from the resamples'
SEARCH_CHUNK = 1 << 14  # prompt counts tried at once by screen_limits' search (a few float64 arrays of this length)


def test_limit(n: int, flips: int | None = None) -> float:
    """The smallest p the sign-flip test can give on n prompts: 2^-(n-1) exact; with Monte Carlo (n above
    EXACT_MAX) also no smaller than 1 / (flips + 1)."""
    if n < 1:
        return 1.0
    exact = 2.0 ** -(n - 1)
    if n <= EXACT_MAX or flips is None:
        return exact
    return max(exact, 1.0 / (flips + 1))


def flips_for(m: int, fdr: float) -> int:
    """Monte Carlo sign patterns for a table of m cells screened at `fdr`: FLIPS_PER_DISCOVERY / (fdr / m),
    within [MIN_FLIPS, MAX_FLIPS], so a p at Benjamini-Hochberg's first threshold is resolved."""
    return int(min(MAX_FLIPS, max(MIN_FLIPS, np.ceil(FLIPS_PER_DISCOVERY * max(1, m) / fdr))))


def sign_flip_p(x: np.ndarray, *, flips: int = MIN_FLIPS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(p, bound) per column of x [n, k] (per-prompt values; NaN counts as 0): the two-sided sign-flip p of
    |sum x| (exact for n <= EXACT_MAX, else Monte Carlo over `flips` patterns, the same patterns for every
    column), and where it is a Monte Carlo p with no exceeding pattern (the exact p may be smaller)."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0)
    if x.ndim == 1:
        x = x[:, None]
    n, k = x.shape
    p, bound = np.ones(k), np.zeros(k, dtype=bool)
    scale = np.abs(x).sum(0)
    live = scale > 0  # an all-zero column: every pattern ties, p = 1
    if n == 0 or not live.any():
        return p, bound
    cols = np.flatnonzero(live)
    z = x[:, cols] / scale[cols]  # each column's |sum| at most 1
    target = np.abs(z.sum(0)) - TIE_RELATIVE
    if n <= EXACT_MAX:
        p[cols] = _exact(z, target) / 2.0 ** n
    else:
        p[cols], bound[cols] = _monte_carlo(z, target, flips, seed)
    return p, bound


def _half_sums(z: np.ndarray) -> np.ndarray:
    """[k, 2^r]: every signed sum of the r rows of z [r, k], one row per column of z."""
    r = z.shape[0]
    signs = 1.0 - 2.0 * ((np.arange(2 ** r)[:, None] >> np.arange(r)[None]) & 1)
    return z.T @ signs.T


def _exact(z: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per column: how many of the 2^n sign patterns give |sum| >= target (the two halves' partial sums a
    and b: |a + b| >= t when b >= t - a or b <= -t - a; t >= 0 up to the tie allowance, and where t < 0 every
    pattern counts)."""
    n, k = z.shape
    r = n // 2
    count = np.empty(k)
    per = max(1, CHUNK_FLOATS // 2 ** max(r, n - r))
    for c0 in range(0, k, per):
        c = slice(c0, min(k, c0 + per))
        # a descending and b ascending per cell (rows): the queries below come in increasing order, so
        # numpy's binary search starts from its previous answer instead of a cache miss per step
        a, b = -np.sort(-_half_sums(z[:r, c]), 1), np.sort(_half_sums(z[r:, c]), 1)
        width, nb = b.shape
        # one sorted array for the chunk: cell j's b lies in [8j - 1, 8j + 1], so searches never cross cells
        off = 8.0 * np.arange(width)[:, None]
        flat = (b + off).ravel()
        t = target[c][:, None]
        start = np.arange(width)[:, None] * nb
        above = start + nb - np.searchsorted(flat, (t - a + off).ravel(), "left").reshape(a.shape)  # b >= t - a
        below = np.searchsorted(flat, (-t - a + off).ravel(), "right").reshape(a.shape) - start  # b <= -t - a
        both = np.where(t < 0, nb, np.minimum(nb, above + below))  # t < 0 (a zero sum): everything ties
        count[c] = both.sum(1)
    return count


def _monte_carlo(z: np.ndarray, target: np.ndarray, flips: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(p, bound) per column by Besag & Clifford's (1991) sequential Monte Carlo: random sign patterns
    until STOP_AFTER of them give |sum| >= target (p = STOP_AFTER / patterns drawn) or `flips` are drawn
    (p = (1 + exceeding) / (flips + 1), a bound where none exceeded). Both are valid p-values; a cell far
    from significance stops after a few hundred patterns, so the cost is that of the small-p cells."""
    n, k = z.shape
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), SEED_KEY]))
    count = np.zeros(k)
    p = np.full(k, np.nan)
    active = np.arange(k)
    done, step = 0, max(1, min(256, CHUNK_FLOATS // max(n, 1)))  # the patterns [step, n] held at once
    while done < flips and active.size:
        step = min(step, flips - done)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(step, n)).astype(np.float64)
        per = max(1, CHUNK_FLOATS // step)
        for c0 in range(0, active.size, per):
            cells = active[c0:c0 + per]
            hits = np.cumsum(np.abs(signs @ z[:, cells]) >= target[cells], 0) + count[cells]
            stop = hits[-1] >= STOP_AFTER
            if stop.any():  # the pattern at which each stopping cell saw its STOP_AFTER-th exceedance
                drawn = done + 1 + (hits[:, stop] >= STOP_AFTER).argmax(0)
                p[cells[stop]] = STOP_AFTER / drawn
            count[cells] = hits[-1]
        done += step
        active = active[np.isnan(p[active])]
        step = min(4 * step, max(1, CHUNK_FLOATS // max(n, active.size, 1)))
    p[active] = (1 + count[active]) / (done + 1)
    bound = np.zeros(k, dtype=bool)
    bound[active] = count[active] == 0
    return p, bound


def refine(p: np.ndarray, bound: np.ndarray, tested: Callable[[np.ndarray], np.ndarray], n: int, m: int,
           level: float, fdr: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, bound, refined): where the interval's p is below 1 - level (the run's interval excludes 0), the
    sign-flip p of the cells' per-prompt tested values, tested(idx) -> [n, len(idx)], where that is below
    1 - level too; elsewhere p and bound unchanged. So p < 1 - L still means exactly that the level-L
    interval excludes 0 at the run's level and every lower one; below 1 - level, p is the sign-flip test's
    (docs/statistics.md). No p is below 2^-(n-1), the limit of any sign-flip test on n prompts: at 5 prompts
    or fewer the interval may exclude 0 while p stays above 1 - level (its interval is too narrow there)."""
    p, bound = p.copy(), bound.copy()
    refined = np.zeros(p.shape, dtype=bool)
    if n >= 2:
        # no test that treats the prompts' signs as exchangeable can give less than 2^-(n-1); below 6 prompts the
        # interval has no small-sample expansion and its inversion can (0.002 at 4 prompts), so p is held there
        floor = 2.0 ** -(n - 1)
        low = np.isfinite(p) & (p < floor)
        p[low], bound[low] = floor, False
    idx = np.flatnonzero(np.isfinite(p) & (p < 1 - level))
    if not idx.size or n < 2:
        return p, bound, refined
    flips = flips_for(m, fdr)
    per = max(1, CHUNK_FLOATS // n)  # cells whose per-prompt values are held at once
    for c0 in range(0, idx.size, per):
        cells = idx[c0:c0 + per]
        sf, sf_bound = sign_flip_p(tested(cells), flips=flips, seed=seed)
        ok = sf < 1 - level
        chosen = cells[ok]
        p[chosen], bound[chosen], refined[chosen] = sf[ok], sf_bound[ok], True
    return p, bound, refined


# ----------------------------------------------------------------------------- what a grid can show

def screen_limits(n: int, m: int, fdr: float, *, n_boot: int, method: str, refine_p: bool = True,
                  effects: tuple[float, ...] = (3.0, 5.0)) -> dict:
    """What a table of m cells tested on n prompts can show at `fdr` (Benjamini-Hochberg), before the run:

    min_p:       the smallest p a cell can have (the sign-flip test's limit, 2^-(n-1) or the Monte Carlo
                 resolution; without refinement, the interval's floor);
    min_q_alone: the smallest q of a cell that is the only small p (min_p x m);
    min_q:       the smallest q at all (every cell at min_p: min_p itself);
    needed_p:    the p a single discovery needs (fdr / m);
    prompts_for: effect size in standard errors at n prompts -> the prompts a cell that large needs to
                 be a discovery on its own: its distance grows as sqrt(n') and it needs p <= fdr / m, read
                 from Student's t with n' - 1 degrees of freedom (the sign-flip test's large-sample
                 behaviour on normal values), and the test's limit at n' <= fdr / m.
    blind:       no cell can be a discovery on its own at n (min_q_alone > fdr).
    cells_together: the fewest cells at min_p that Benjamini-Hochberg makes discoveries together
                 (ceil(min_p m / fdr)); None where even all m cells there would not be (min_p > fdr)."""
    from .levels import expands, p_floor

    flips = flips_for(m, fdr)

    def limit(k: np.ndarray) -> np.ndarray:  # the smallest p on k prompts: the data's (sign-flip) or the floor's
        if refine_p:
            return np.array([test_limit(int(j), flips) for j in k])
        return np.array([p_floor(n_boot, int(j), expands(method, int(j))) if n_boot else 1.0 for j in k])
    min_p = float(limit(np.array([n]))[0]) if n >= 2 else 1.0
    needed = fdr / max(1, m)
    z_needed = -float(ndtri(np.array(needed / 2)))
    small = np.arange(2, 201)
    reach = small[limit(small) <= needed]
    n_min = int(reach[0]) if reach.size else None  # the fewest prompts whose test can reach fdr / m

    def prompts(effect: float) -> int | None:
        if effect <= 0 or n_min is None or n < 2:
            return None
        for lo in range(n_min, 1_000_001, SEARCH_CHUNK):  # a slice of k at a time: no million-long temporaries
            k = np.arange(lo, min(lo + SEARCH_CHUNK, 1_000_001))
            ok = effect * np.sqrt(k / n) >= t_quantile(z_needed, k - 1)
            if ok.any():
                return int(k[ok.argmax()])
        return None
    return {"n": n, "m": m, "fdr": fdr, "min_p": min_p, "min_q_alone": min(1.0, min_p * m), "min_q": min_p,
            "needed_p": needed, "min_prompts": n_min, "prompts_for": {e: prompts(e) for e in effects},
            "blind": min_p * m > fdr,
            "cells_together": int(np.ceil(min_p * m / fdr - 1e-9)) if min_p <= fdr else None}


def screen_text(limits: dict) -> str:
    """One plan line: the smallest p and q, and the prompts an effect of 3 and 5 standard errors needs."""
    need = ", ".join(f"{e:g} SE: {k if k is not None else 'none'}" for e, k in limits["prompts_for"].items())
    return (f"screen of {limits['m']:,} cells at fdr {limits['fdr']:g} over {limits['n']} prompts: smallest p "
            f"{limits['min_p']:.2g}, smallest q {limits['min_q']:.2g} (a cell alone: {limits['min_q_alone']:.2g}; "
            f"a discovery alone needs p <= {limits['needed_p']:.2g}); prompts a cell needs to survive alone, by "
            f"its distance from zero in standard errors at {limits['n']} prompts: {need}")
