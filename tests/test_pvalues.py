"""p-values that agree with the intervals and hold their level (docs/statistics.md, "Effects against zero").

`<name>_p` is the inversion of the table's own interval: the smallest 1 - L at which the level-L
interval excludes 0. Checked here against things the inversion does not compute:
- the intervals themselves, recomputed at many levels from the same resamples (the definition);
- simulated null datasets (the rejection rate at 0.05 for 16 and 32 prompts);
- the t-test on large normal samples, and the plain percentile's share of resamples beyond 0;
- every table with a `_p` column that the operations make on the demo model.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

import entoscope as es
from entoscope.stats import FunctionStat, Stats, benjamini_hochberg, mean_stat, resample_weights, summarise
from entoscope.stats.levels import p_floor

METHODS = ["bca", "expanded_percentile", "percentile"]
LEVELS = [0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995]


def _excludes_zero(s) -> np.ndarray:
    return (s.ci_low > 0) | (s.ci_high < 0)


def _awkward_cells(n: int, rng: np.random.Generator) -> np.ndarray:
    """[n, cells]: symmetric, skewed both ways, heavy-tailed, one prompt carrying the cell, constant,
    all zero, and NaN entries (a cell skipping some prompts)."""
    cols = [rng.normal(0.3, 1.0, (n, 60)), rng.exponential(1.0, (n, 60)) - 0.8, 0.8 - rng.exponential(1.0, (n, 60)),
            rng.standard_t(2, (n, 60)) + 0.4, rng.lognormal(0, 1.5, (n, 60)) - 1.5]
    one = np.zeros((n, 20))
    one[0] = rng.normal(0, 3, 20)
    cols += [one, np.full((n, 3), 2.0), np.zeros((n, 3))]
    x = np.concatenate(cols, axis=1)
    x[rng.random(x.shape) < 0.08] = np.nan
    return x


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [7, 16, 40])
def test_p_below_one_minus_level_exactly_when_the_interval_at_that_level_excludes_zero(method, n):
    x = _awkward_cells(n, np.random.default_rng(n))
    stat = mean_stat(x)
    at_95 = summarise(stat, Stats(n_boot=400, ci_method=method), seed=3)
    assert np.isfinite(at_95.p_value[np.isfinite(at_95.value)]).all()
    # a p the interval puts below 2^-(n-1), the sign-flip limit, is held there (docs/statistics.md)
    held = ~at_95.p_refined & (at_95.p_value == 2.0 ** -(n - 1))
    for level in LEVELS:  # the same resamples (same seed) at another level
        s = summarise(stat, Stats(n_boot=400, ci_method=method, ci_level=level, refine_p=False), seed=3)
        # the interval's p does not depend on the level asked
        kept = ~at_95.p_refined & ~held
        np.testing.assert_array_equal(s.p_value[kept], at_95.p_value[kept])
        assert (s.p_value[held] <= 2.0 ** -(n - 1)).all()
        ok = np.isfinite(s.ci_low)
        rejects = at_95.p_value < 1 - level
        # a p held at the resampling's resolution (the floor) says only p <= floor: below the floor's level its
        # interval may exclude 0 while p does not reject. A p below the run's 1 - 0.95 is the sign-flip test's
        # (stats/signflip.py): it agrees with the intervals at 95% and every lower level only
        floor = p_floor(400, n, method != "percentile" and n >= 6)
        exact = ok & np.where(at_95.p_refined, 1 - level >= 0.05, ~at_95.p_bound | (1 - level > floor))
        # below the level 1 - 2^-(n-1) a held cell's interval may exclude 0 while p does not reject
        exact &= ~held | (1 - level > 2.0 ** -(n - 1))
        np.testing.assert_array_equal(rejects[exact], _excludes_zero(s)[exact], err_msg=f"level {level}")
    assert (at_95.p_value[at_95.p_refined] < 0.05).all()  # refined only where the 95% interval excludes 0
    assert np.unique(at_95.p_value[at_95.p_bound & ~at_95.p_refined]).size <= 1  # one floor per table


@pytest.mark.parametrize("n", [16, 32])
def test_under_a_true_null_p_below_005_in_3_to_7_percent_of_4000_datasets(n):
    rejected = []
    for seed in range(4):  # 4 x 1,000 independent datasets, each its own cell (own resampling per batch)
        x = np.random.default_rng(100 + seed).normal(0.0, 1.0, size=(n, 1000))
        s = summarise(mean_stat(x), Stats(n_boot=1000), seed=seed)
        assert (s.p_value > 0).all()
        rejected.append(s.p_value < 0.05)
        np.testing.assert_array_equal(s.p_value < 0.05, _excludes_zero(s))
    rate = float(np.mean(rejected))
    assert 0.03 <= rate <= 0.07, rate


def test_on_large_normal_samples_p_is_the_t_tests():
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 1.0, size=(400, 40)) + np.linspace(0.0, 0.2, 40)
    s = summarise(mean_stat(x), Stats(n_boot=4000, ci_method="expanded_percentile"), seed=2)
    t = sps.ttest_1samp(x, 0.0).pvalue
    middle = (t > 0.01) & (t < 0.8)  # where 4,000 resamples resolve p well
    assert middle.sum() > 20
    np.testing.assert_allclose(s.p_value[middle], t[middle], rtol=0.2, atol=0.01)


def test_the_plain_percentile_p_is_twice_the_share_of_resamples_beyond_zero():
    rng = np.random.default_rng(8)
    x = rng.exponential(1.0, (25, 30)) - np.linspace(0.6, 1.3, 30)
    B = 2000
    s = summarise(mean_stat(x), Stats(n_boot=B, ci_method="percentile", refine_p=False), seed=4)
    W = resample_weights(25, B, 4)
    boot = np.stack([x[np.repeat(np.arange(25), w.astype(int))].mean(0) for w in W])  # resampled sets written out
    share = np.minimum((boot < 0).mean(0), (boot > 0).mean(0))
    np.testing.assert_allclose(s.p_value, np.maximum(2 * share, 2 / (B + 1)), atol=2.5 / B)
    # plain: the alpha/2 and 1 - alpha/2 quantiles, no small-sample widening
    np.testing.assert_allclose(s.ci_low, np.quantile(boot, 0.025, axis=0), atol=1e-12)
    np.testing.assert_allclose(s.ci_high, np.quantile(boot, 0.975, axis=0), atol=1e-12)


@pytest.mark.parametrize("n", [6, 16, 50])
def test_p_is_never_zero_but_the_resolution_of_the_resamples_flagged_as_a_bound(n):
    """The interval's own p (refine_p False; the sign-flip refinement is tests/test_signflip.py)."""
    x = np.random.default_rng(1).normal(10.0, 1.0, size=(n, 4))  # every resample far from 0
    x[:, 1] *= -1
    B = 999
    plain = summarise(mean_stat(x), Stats(refine_p=False, n_boot=B, ci_method="percentile"), seed=0)
    np.testing.assert_allclose(plain.p_value, 2 / (B + 1), rtol=1e-9)  # a crossing at 1 / (B + 1), both tails
    assert plain.p_bound.all()
    expanded = summarise(mean_stat(x), Stats(refine_p=False, n_boot=B, ci_method="expanded_percentile"), seed=0)
    # the expanded tails: the level whose normal quantile is sqrt(n / (n-1)) t_{n-1}(z) is 1 / (B + 1)
    z = sps.norm.ppf(1 / (B + 1)) / np.sqrt(n / (n - 1))
    np.testing.assert_allclose(expanded.p_value, 2 * sps.t.cdf(z, n - 1), rtol=0.03)
    assert expanded.p_bound.all() and (expanded.p_value > plain.p_value).all()
    bca = summarise(mean_stat(x), Stats(refine_p=False, n_boot=B), seed=0)
    assert (bca.p_value > 0).all() and bca.p_bound.all()
    q = benjamini_hochberg(bca.p_value)
    assert (q > 0).all()


def test_a_cell_constant_at_zero_has_p_one_and_a_constant_nonzero_cell_the_bound():
    x = np.column_stack([np.zeros(10), np.full(10, 3.0)])
    s = summarise(mean_stat(x), Stats(refine_p=False, n_boot=200), seed=0)
    assert s.p_value[0] == 1.0 and not s.p_bound[0]
    assert 0 < s.p_value[1] < 0.05 and s.p_bound[1]


def test_the_block_path_and_the_whole_matrix_path_give_the_same_p():
    x = _awkward_cells(30, np.random.default_rng(2))
    ok = np.isfinite(x)
    num, den = np.where(ok, x, 0.0), ok.astype(float)

    def fn(W, cols):
        a, d = W @ num[:, cols], W @ den[:, cols]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(d != 0, a / np.where(d != 0, d, 1.0), np.nan)
    for method in METHODS:
        streamed = summarise(mean_stat(x), Stats(refine_p=False, n_boot=300, ci_method=method), seed=6)
        whole = summarise(FunctionStat(fn, *x.shape), Stats(refine_p=False, n_boot=300, ci_method=method), seed=6)
        np.testing.assert_allclose(streamed.p_value, whole.p_value, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(streamed.p_bound, whole.p_bound)


# ------------------------------------------------------------------ every table with a p on the demo model
def _tested_interval(t, stem: str) -> tuple[np.ndarray, np.ndarray]:
    """The interval a `_p` column tests: its own, or for an "absolute" patching table the difference's."""
    if stem == "value" and "difference_ci_low" in t:
        return t["difference_ci_low"].to_numpy(float), t["difference_ci_high"].to_numpy(float)
    return t[f"{stem}_ci_low"].to_numpy(float), t[f"{stem}_ci_high"].to_numpy(float)


def _check_table(t, what: str) -> int:
    """Every `_p` column of t: p < 1 - level exactly where the interval excludes 0, p > 0, q = BH(p)."""
    stems = [c[:-2] for c in t.columns if c.endswith("_p") and f"{c[:-2]}_ci_low" in t]
    for stem in stems:
        p = t[f"{stem}_p"].to_numpy(float)
        low, high = _tested_interval(t, stem)
        ok = np.isfinite(p) & np.isfinite(low)
        assert ok.any(), (what, stem)
        level = float(t["ci_level"].iloc[0])
        excludes = (low > 0) | (high < 0)
        np.testing.assert_array_equal((p < 1 - level)[ok], excludes[ok], err_msg=f"{what}: {stem}")
        assert (p[ok] > 0).all(), (what, stem)
        np.testing.assert_allclose(t[f"{stem}_q"].to_numpy(float), benjamini_hochberg(p), rtol=1e-12)
        assert (t["significant"] == (t[f"{stem}_q"] <= 0.05)).all()
    return len(stems)


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _operations():
    ioi = {"task": "ioi", "n": 12, "seed": 7}
    return [
        ("patching resid_pre by role", es.Patching(sites={"activation": "resid_pre", "over": ["layer", "position"],
                                                          "positions": ["IO", "S1", "S2", "END"]}), ioi),
        ("patching heads, difference", es.Patching(sites={"activation": "z", "over": ["layer", "head"]},
                                                   comparison="difference"), ioi),
        ("patching mlp_out, absolute", es.Patching(sites={"activation": "mlp_out", "over": ["layer"]},
                                                   comparison="absolute"), ioi),
        ("patching attribution", es.Patching(method="attribution",
                                             sites={"activation": "z", "over": ["layer", "head"]}), ioi),
        ("dla", es.DirectLogitAttribution(metric="logit_diff"), ioi),
        ("dla neurons", es.DirectLogitAttribution(metric="logit_diff", neurons=True), ioi),
        ("circuits edges", es.Circuits(method="eap", n_edges=10, faithfulness=[]), {"task": "induction", "n": 12}),
        ("lens", es.Lens(sites={"activation": "resid_post", "over": ["layer", "position"], "positions": "-3:"}), ioi),
        ("head scores", es.HeadScores(), {"task": "induction", "n": 8}),
        ("probing", es.Probing(sites={"activation": "resid_post", "over": ["layer"]}), {"task": "ioi", "n": 40}),
    ]


def test_every_table_with_a_p_agrees_with_its_interval_on_every_row(demo):
    tested = []
    for what, op, data in _operations():
        t = op.run(demo, data, quiet=True).table
        if _check_table(t, what):
            tested.append(what)
        else:  # lens and probing test nothing against 0: no p column at all
            assert not any(c.endswith(("_p", "_q")) for c in t.columns), what
    assert {"dla", "dla neurons", "circuits edges", "patching mlp_out, absolute", "head scores"} <= set(tested), tested


def test_a_page_reads_a_bound_p_as_less_than_its_floor():
    from entoscope.results.page import table_html

    x = np.column_stack([np.full(12, 1.0) + np.linspace(0, 0.1, 12), np.linspace(-1, 1.2, 12)])
    s = summarise(mean_stat(x), Stats(refine_p=False, n_boot=300, ci_method="percentile"), seed=0)
    assert list(s.p_bound) == [True, False]
    page = table_html(pd.DataFrame({"value": s.value, "value_p": s.p_value, "value_p_bound": s.p_bound}))
    assert f"&lt; {2 / 301:.2g}" in page and "value_p_bound" not in page
    assert f">{s.p_value[1]:.2g}<" in page
