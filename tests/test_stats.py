"""The statistics layer against brute force and known answers: coverage, leave-one-out, BH, resampling."""

from __future__ import annotations

import numpy as np
import pytest

from entoscope.stats import (FunctionStat, Stats, benjamini_hochberg, leave_one_out, mean_stat, ratio_stat,
                             resample_weights, summarise)


@pytest.mark.parametrize("method", ["expanded_percentile", "bca"])
def test_95_percent_intervals_cover_a_known_mean_in_93_to_97_percent_of_400_sets(method):
    rng = np.random.default_rng(2024)
    sets = rng.normal(3.0, 2.0, size=(400, 50))  # 400 independent datasets of 50 prompts, true mean 3
    s = summarise(mean_stat(sets.T), Stats(n_boot=1000, ci_method=method), seed=11)  # one cell per dataset
    covered = np.mean((s.ci_low <= 3.0) & (3.0 <= s.ci_high))
    assert 0.93 <= covered <= 0.97, covered
    np.testing.assert_allclose(s.value, sets.mean(1))


def test_bootstrap_values_are_means_of_resampled_prompts():
    x = np.random.default_rng(0).normal(size=(12, 3))
    W = resample_weights(12, 50, seed=5)
    assert (W.sum(1) == 12).all()
    stat = mean_stat(x)
    for row in range(5):
        idx = np.repeat(np.arange(12), W[row].astype(int))  # the resampled dataset, written out
        np.testing.assert_allclose(stat(W[row:row + 1])[0], x[idx].mean(0), atol=1e-12)


def test_ratio_of_means_and_leave_one_out_by_brute_force():
    rng = np.random.default_rng(1)
    patched, base, source = rng.normal(size=(9, 4)), rng.normal(size=9), rng.normal(size=9) + 5
    stat = ratio_stat(patched - base[:, None], source - base)
    direct = (patched.mean(0) - base.mean()) / (source.mean() - base.mean())
    np.testing.assert_allclose(stat(np.ones((1, 9)))[0], direct)
    loo = leave_one_out(stat)
    for i in range(9):
        keep = np.arange(9) != i
        expected = (patched[keep].mean(0) - base[keep].mean()) / (source[keep].mean() - base[keep].mean())
        np.testing.assert_allclose(loo[i], expected, atol=1e-12)
    s = summarise(stat, Stats(n_boot=200), seed=0)
    worst = np.abs(loo - direct).argmax(0)
    np.testing.assert_array_equal(s.influential, worst)
    np.testing.assert_allclose(s.influence, np.abs(loo - direct).max(0))


def test_nan_entries_are_skipped_and_an_undefined_cell_stays_nan():
    x = np.array([[1.0, np.nan], [3.0, np.nan], [np.nan, np.nan]])
    s = summarise(mean_stat(x), Stats(n_boot=100), seed=0)
    assert s.value[0] == 2.0 and np.isnan(s.value[1]) and np.isnan(s.ci_low[1])


def test_benjamini_hochberg_matches_a_hand_computed_case():
    p = np.array([0.01, 0.04, 0.03, 0.005, np.nan, 0.5])
    # sorted finite: 0.005, 0.01, 0.03, 0.04, 0.5 (m = 5): p*m/rank = .025, .025, .05, .05, .5
    q = benjamini_hochberg(p)
    np.testing.assert_allclose(q, [0.025, 0.05, 0.05, 0.025, np.nan, 0.5])


def test_p_values_separate_a_null_cell_from_an_effect_and_se_is_the_means():
    rng = np.random.default_rng(3)
    x = np.column_stack([rng.normal(0.0, 1.0, 200), rng.normal(1.0, 1.0, 200)])
    s = summarise(mean_stat(x), Stats(n_boot=2000), seed=1)
    np.testing.assert_allclose(s.se, x.std(0, ddof=1) / np.sqrt(200), rtol=0.1)  # the mean's standard error
    # the effect (mean 1, se 0.07) is past every resample: p is the resolution of 2,000 resamples, a bound
    assert s.p_bound[1] and 0 < s.p_value[1] < 2e-3
    assert not s.p_bound[0] and s.p_value[0] > 1e-3


def test_a_function_statistic_works_like_a_ratio():
    x = np.arange(10.0)
    fn = FunctionStat(lambda W, cols: (W @ x[:, None]) / W.sum(1, keepdims=True), n=10, n_cells=1)
    a = summarise(fn, Stats(n_boot=300), seed=4)
    b = summarise(mean_stat(x), Stats(n_boot=300), seed=4)
    np.testing.assert_allclose([a.value, a.ci_low, a.ci_high], [b.value, b.ci_low, b.ci_high])


@pytest.mark.parametrize("shift", [-1e-15, 1e-15])
def test_bca_interval_does_not_move_with_the_rounding_of_resamples_that_equal_the_estimate(shift):
    """On 4 prompts 24 of 256 resamples draw every prompt once: their value is the estimate, and a many-row
    product may round it an ulp either side. Counted as ties either way, the interval is the exact one."""
    x = np.array([0.09481438, -0.00389504, 0.0456938, -0.05381558])

    def mean(W, cols, shift=0.0):
        v = (W @ x) / W.sum(1)
        return (v + shift * (W == 1).all(1) * (W.shape[0] > 1))[:, None]  # only the resampled rows drift

    exact = summarise(FunctionStat(mean, n=4, n_cells=1), Stats(n_boot=1000), seed=2)
    drift = summarise(FunctionStat(lambda W, c: mean(W, c, shift), n=4, n_cells=1), Stats(n_boot=1000), seed=2)
    assert (resample_weights(4, 1000, seed=2) == 1).all(1).sum() > 50  # the case is there: ~94 such resamples
    np.testing.assert_allclose([drift.ci_low[0], drift.ci_high[0]], [exact.ci_low[0], exact.ci_high[0]], atol=1e-12)


@pytest.mark.parametrize("n", [1, 4, 16, 50])
def test_wilson_interval_is_the_set_of_proportions_the_score_test_keeps(n):
    """Brute force: on a fine grid of proportions pi, pi lies inside the interval exactly when the binomial
    score statistic |k/n - pi| / sqrt(pi (1 - pi) / n) is at most z (Wilson 1927)."""
    from statistics import NormalDist

    from entoscope.stats import wilson_interval

    z = NormalDist().inv_cdf(0.975)
    k = np.arange(n + 1)
    low, high = wilson_interval(k, n, 0.95)
    grid = np.linspace(1e-6, 1 - 1e-6, 20001)
    for kk, lo, hi in zip(k, low, high):
        kept = np.abs(kk / n - grid) <= z * np.sqrt(grid * (1 - grid) / n)
        assert grid[kept].min() == pytest.approx(lo, abs=1e-4) and grid[kept].max() == pytest.approx(hi, abs=1e-4)
    assert low[-1] == pytest.approx(n / (n + z * z)) and high[-1] == 1.0 and low[0] == 0.0


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_wilson_ends_are_exact_at_0_and_n_successes_and_the_interval_is_symmetric(level):
    """At 0 successes no proportion below 0 exists, so the lower end is exactly 0 (the written formula left
    2.8e-17 at some n), at n of n the upper end exactly 1; and the interval of k failures is the mirror of
    k successes', high(k) = 1 - low(n - k), exactly (Wilson 1927: the score test is symmetric in p, 1 - p).
    Elsewhere it is the formula written out by hand (wilson_by_hand.py)."""
    from entoscope.stats import share_interval, wilson_interval
    from wilson_by_hand import wilson_by_hand

    n = np.arange(1, 300)
    low0, high0 = wilson_interval(np.zeros_like(n), n, level)
    lown, highn = wilson_interval(n, n, level)
    assert (low0 == 0.0).all() and (highn == 1.0).all()
    np.testing.assert_array_equal(high0, 1.0 - lown)
    s_low, s_high = share_interval(np.zeros(len(n)), n, level)  # every caller goes through wilson_interval
    assert (s_low == 0.0).all() and (share_interval(np.ones(len(n)), n, level)[1] == 1.0).all()
    for nn in (1, 7, 40, 299):
        k = np.arange(nn + 1)
        lo, hi = wilson_interval(k, nn, level)
        np.testing.assert_array_equal(hi, 1.0 - lo[::-1])
        by_hand = np.array([wilson_by_hand(int(kk), nn, level) for kk in k])
        np.testing.assert_allclose(lo, by_hand[:, 0], atol=1e-12)
        np.testing.assert_allclose(hi, by_hand[:, 1], atol=1e-12)
