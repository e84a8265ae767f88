"""The sign-flip test behind p-values below the interval's resolution (stats/signflip.py; docs/statistics.md).

Checked against things it does not compute: a hand enumeration, a brute-force enumeration of every sign
pattern (itertools), simulated null datasets (rejection rates at 0.05, 0.005 and 0.05 / 270), and a cell
5.6 standard errors from zero in a 270-cell table over 32 prompts (the SmolLM2 head grid of issue 34).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import entoscope.stats.signflip as sf
from entoscope.stats import Stats, benjamini_hochberg, mean_stat, ratio_stat, summarise
from entoscope.stats.levels import p_floor


def _brute(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sums = np.array(list(itertools.product([-1.0, 1.0], repeat=n))) @ x
    return (np.abs(sums) >= np.abs(x.sum(0)) - 1e-12).mean(0)


def test_a_tiny_case_by_hand():
    # (3, 1, 2): the 8 signed sums are +-6, +-4, +-2, 0, 0; |sum| >= 6 for 2 of them
    # (3, 1, -1): +-5, +-3, +-3, +-1; |sum| >= 3 for 6 of them
    p, bound = sf.sign_flip_p(np.array([[3.0, 3.0], [1.0, 1.0], [2.0, -1.0]]))
    np.testing.assert_allclose(p, [2 / 8, 6 / 8])
    assert not bound.any()


@pytest.mark.parametrize("n", [1, 2, 5, 9, 12])
def test_exact_counts_equal_every_sign_pattern_written_out(n):
    rng = np.random.default_rng(n)
    x = rng.normal(0.4, 1.0, (n, 40))
    x[:, 0] = 0.0  # all zero: p = 1
    x[:, 1] = np.r_[1.0, np.zeros(n - 1)]  # one prompt: p = 1
    x[:, 2:6] = np.round(x[:, 2:6])  # ties between patterns
    x[:, 6] = 2.5  # constant: p = 2 / 2^n, the test's limit
    p, bound = sf.sign_flip_p(x)
    np.testing.assert_allclose(p, _brute(x), rtol=1e-12)
    assert p[6] == pytest.approx(sf.test_limit(n)) and not bound.any()


def test_monte_carlo_agrees_with_the_enumeration_within_its_error(monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.normal(0.5, 1.0, (14, 30))
    exact = _brute(x)
    monkeypatch.setattr(sf, "EXACT_MAX", 10)
    p, bound = sf.sign_flip_p(x, flips=200_000, seed=1)
    # Besag-Clifford: a cell stops at its 20th exceeding pattern (relative error ~ 1 / sqrt(20)); the others
    # run all 200,000 patterns
    stopped = exact > 20 / 200_000 * 3
    assert np.all(np.abs(p[stopped] / exact[stopped] - 1) < 4 / np.sqrt(20))
    assert np.all(np.abs(p[~stopped] - exact[~stopped]) <= 4 * np.sqrt(exact[~stopped] / 200_000) + 1e-5)
    assert (p > 0).all() and not bound.any()


def _within(count: int, expected: float, sds: float = 4.0) -> bool:
    """A binomial count within `sds` standard deviations of its expectation."""
    return abs(count - expected) <= sds * np.sqrt(expected) + 1


@pytest.mark.parametrize("dist", ["normal", "laplace"])
@pytest.mark.parametrize("n", [16, 32])
def test_under_a_symmetric_null_the_test_rejects_at_its_level(n, dist):
    """16 prompts: the exact enumeration; 32: Monte Carlo with the flips of a 270-cell table."""
    N = 20_000
    rng = np.random.default_rng(10 * n + len(dist))
    x = rng.normal(size=(n, N)) if dist == "normal" else rng.laplace(size=(n, N))
    p, _ = sf.sign_flip_p(x, flips=sf.flips_for(270, 0.05), seed=n)
    for alpha in (0.05, 0.005):
        assert _within(int((p < alpha).sum()), alpha * N), (alpha, (p < alpha).mean())
    assert (p < 0.05 / 270).sum() <= 12  # expected 3.7


@pytest.mark.slow
@pytest.mark.parametrize("dist", ["normal", "laplace"])
@pytest.mark.parametrize("n", [16, 32])
def test_under_a_symmetric_null_the_test_rejects_at_005_over_270(n, dist):
    N = 200_000  # 37 rejections expected at 0.05 / 270
    rng = np.random.default_rng(20 * n + len(dist))
    x = rng.normal(size=(n, N)) if dist == "normal" else rng.laplace(size=(n, N))
    p, _ = sf.sign_flip_p(x, flips=sf.flips_for(270, 0.05), seed=n)
    assert _within(int((p < 0.05 / 270).sum()), 0.05 / 270 * N), (p < 0.05 / 270).mean()


@pytest.mark.parametrize("n", [16, 32])
def test_the_reported_p_holds_its_level_below_the_intervals_resolution(n):
    """The whole path (interval, then the sign-flip below 1 - ci_level) on normal null datasets: p < 0.05
    as often as the interval misses 0 (3-7%), p < 0.005 in 0.5% within binomial error (the interval alone
    rejects 0.8% at 32 prompts, docs/statistics.md)."""
    N = 10_000
    x = np.random.default_rng(n).normal(size=(n, N))
    s = summarise(mean_stat(x), Stats(), seed=1)
    assert 0.03 <= (s.p_value < 0.05).mean() <= 0.07
    assert _within(int((s.p_value < 0.005).sum()), 0.005 * N)
    np.testing.assert_array_equal(s.p_value < 0.05, (s.ci_low > 0) | (s.ci_high < 0))  # the guarantee at 95%
    assert s.p_refined.any() and (s.p_value[s.p_refined] < 0.05).all()


def test_a_cell_56_standard_errors_from_zero_survives_a_270_cell_screen_over_32_prompts():
    """A patching-like ratio of means (patched - base over source - base) of 270 heads, 32 pairs; one head's
    per-pair differences are 5.6 standard errors from zero, the others are noise. With the interval's p alone
    (floor 0.0048) no head can be a discovery; with the sign-flip refinement that head's q is below 0.05."""
    rng = np.random.default_rng(34)
    n, m = 32, 270
    diff = rng.normal(0.0, 1.0, (n, m))
    d = rng.normal(0.0, 1.0, n)
    diff[:, 0] = d - d.mean() + 5.6 * d.std(ddof=1) / np.sqrt(n)  # mean exactly 5.6 standard errors
    gap = rng.normal(10.0, 1.0, n)
    t = diff[:, 0].mean() / (diff[:, 0].std(ddof=1) / np.sqrt(n))
    assert t == pytest.approx(5.6)
    stat = ratio_stat(diff, gap)
    old = summarise(stat, Stats(refine_p=False), seed=0)
    assert old.p_value[0] == pytest.approx(p_floor(1000, n, True)) and old.p_bound[0]
    assert benjamini_hochberg(old.p_value)[0] > 0.05  # blind: the floor x 270 / (cells at the floor)
    new = summarise(stat, Stats(), seed=0)
    q = benjamini_hochberg(new.p_value)
    assert q[0] < 0.05 and new.p_refined[0]
    # no flip of 54,000 exceeds (p at the Monte Carlo resolution, a bound); 400,000 independent flips agree
    assert new.p_bound[0] and new.p_value[0] == pytest.approx(1 / (sf.flips_for(m, 0.05) + 1))
    assert _brute_mc(diff[:, 0]) < new.p_value[0]


def _brute_mc(x: np.ndarray, draws: int = 400_000) -> float:
    """An independent Monte Carlo sign-flip p (numpy signs, its own stream)."""
    rng = np.random.default_rng(99)
    hits = 0
    for _ in range(draws // 50_000):
        s = rng.choice([-1.0, 1.0], size=(50_000, x.size))
        hits += int((np.abs(s @ x) >= abs(x.sum()) - 1e-12).sum())
    return (hits + 1) / (draws + 1)


def test_a_skewed_null_is_outside_the_tests_null():
    """Centred exponential values have mean 0 but are not symmetric: the sign-flip test rejects them more
    often than its level (the rates docs/statistics.md states: ~2% at 0.005 over 16 prompts)."""
    x = np.random.default_rng(2).exponential(size=(16, 10_000)) - 1.0
    p, _ = sf.sign_flip_p(x)
    assert 0.0125 < (p < 0.005).mean() < 0.035


def test_the_screen_limits_of_a_grid():
    lim = sf.screen_limits(16, 270, 0.05, n_boot=1000, method="bca")
    assert lim["min_p"] == pytest.approx(2.0 ** -15) and lim["needed_p"] == pytest.approx(0.05 / 270)
    assert lim["min_q_alone"] == pytest.approx(270 * 2.0 ** -15) and not lim["blind"]
    old = sf.screen_limits(16, 270, 0.05, n_boot=1000, method="bca", refine_p=False)
    assert old["min_p"] == pytest.approx(p_floor(1000, 16, True)) and old["blind"]
    edges = sf.screen_limits(8, 70_651, 0.05, n_boot=1000, method="bca")
    assert edges["blind"] and edges["min_p"] == pytest.approx(2.0 ** -7)
    assert edges["min_prompts"] == 22  # 2^-(k-1) <= 0.05 / 70,651 = 7.1e-7 from k = 22 on
    # BH makes discoveries of r cells at p = 2^-7 when 2^-7 <= 0.05 r / 70,651: r >= 11,039.2
    assert edges["cells_together"] == 11_040 and lim["cells_together"] == 1
    assert sf.screen_limits(5, 12, 0.05, n_boot=1000, method="bca")["cells_together"] is None  # 2^-4 > 0.05
    assert lim["min_prompts"] == 14 and 2.0 ** -13 <= 0.05 / 270 < 2.0 ** -12
    # a cell 5 standard errors from zero at 16 prompts: |t| > 4.6 (t_15 at p = 1.9e-4 two-sided) already
    assert lim["prompts_for"][5.0] == 16
    # 3 standard errors at 16 prompts: at k prompts 3 sqrt(k / 16) must pass t_{k-1}'s quantile (~4.2 at 31)
    assert 28 <= lim["prompts_for"][3.0] <= 36


def test_the_plan_says_what_the_screen_can_show_and_warns_before_a_blind_run():
    import warnings

    import entoscope as es

    demo = es.load_model("demo")
    op = es.Patching(sites={"activation": "z", "over": ["layer", "head"]})  # 12 heads
    with pytest.warns(es.errors.EntoscopeWarning, match=r"\[screen_blind\].*use 9 prompts or more"):
        plan = op.plan(demo, {"task": "ioi", "n": 5})  # 2^-4 = 0.0625 > 0.05 / 12: blind; 2^-8 <= 0.0042 from 9
    assert plan.screen["blind"] and plan.screen["min_p"] == pytest.approx(2.0 ** -4)
    assert any(n.startswith("screen of 12 cells at fdr 0.05 over 5 prompts: smallest p 0.062") for n in plan.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = op.plan(demo, {"task": "ioi", "n": 9})
    assert not plan.screen["blind"] and plan.screen["min_q_alone"] == pytest.approx(12 * 2.0 ** -8)
    assert es.Lens(sites={"activation": "resid_post", "over": ["layer"]}).plan(demo, {"task": "ioi", "n": 4}).screen \
        is None  # nothing tested against 0


def test_no_p_is_below_what_a_sign_flip_test_on_n_prompts_can_give():
    """At 4 prompts all of one sign the interval's inversion reaches its floor (no small-sample expansion
    below 6 prompts); the reported p is held at 2^-(n-1) = 0.125, the exact sign-flip p of that data
    (2 of the 16 sign patterns reach |sum|: all + and all -), counted here."""
    import itertools

    import numpy as np

    x = np.array([[1.0], [1.2], [0.9], [1.1]])  # 4 prompts, 1 cell, far from 0
    exact = np.mean([abs(sum(s * v for s, v in zip(signs, x[:, 0]))) >= abs(x[:, 0].sum()) - 1e-12
                     for signs in itertools.product([1, -1], repeat=4)])
    assert exact == 0.125
    plain = summarise(mean_stat(x), Stats(refine_p=False), seed=0)
    assert plain.p_value[0] < 0.05  # the interval alone would call it
    held = summarise(mean_stat(x), Stats(), seed=0)
    assert held.p_value[0] == exact and not held.p_bound[0]


def test_a_page_reads_a_p_at_the_tests_limit_as_at_most_that_limit():
    """Issue 34: 16 prompts all on one side give the exact sign-flip p 2 / 2^16 (the data's pattern and its
    negation), the smallest any sign-flip test on 16 prompts can give: the page reads it "<= 3.1e-05", a
    larger p plainly, a Monte Carlo bound "< ..."; a confirmation table's screen_ columns by its screen's
    prompts."""
    import pandas as pd

    from entoscope.results.page import table_html

    x = np.column_stack([np.linspace(0.5, 2.0, 16), np.r_[np.linspace(0.5, 2.0, 15), -0.6]])
    p, bound = sf.sign_flip_p(x)
    assert p[0] == 2 / 2 ** 16 and p[1] > p[0] and not bound.any()
    frame = pd.DataFrame({"value_p": [p[0], p[1], 0.002], "value_p_bound": [False, False, True], "n_prompts": 16})
    page = table_html(frame)
    assert "&lt;= 3.1e-05" in page and f">{p[1]:.2g}<" in page and "&lt; 0.002" in page
    confirmation = pd.DataFrame({"screen_value_p": [2.0 ** -11], "screen_value_p_bound": [False],
                                 "screen_n_prompts": [12], "value_p": [2.0 ** -11], "value_p_bound": [False],
                                 "n_prompts": [16]})
    page = table_html(confirmation)
    assert page.count("&lt;= 0.00049") == 1 and f">{2.0 ** -11:.2g}<" in page  # 12 prompts' limit, not 16's
