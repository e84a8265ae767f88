"""Intervals of lens, DLA, head scores and probing against a brute-force bootstrap written here.

Each operation runs once on the demo model (percentile intervals); the test resamples the per-prompt
table with its own generator (numpy), recomputes the aggregate from scratch, and takes the
percentile interval at the small-sample-expanded levels computed here with scipy (Hesterberg 2015:
alpha' = Phi(sqrt(n / (n-1)) t_{n-1}(alpha))). Two independent bootstraps agree up to Monte-Carlo
error, hence the tolerance (a share of the interval's width). The probing metrics under resampling
weights are also checked against scikit-learn on the resampled rows written out (np.repeat).
"""

import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from sklearn.metrics import (
    accuracy_score,
    f1_score,
    mean_squared_error,
    r2_score,
    roc_auc_score,
)

import entoscope as es
from entoscope.circuits.dla import summarise_dla
from entoscope.circuits.head_scores import summarise_head_scores
from entoscope.lens.operation import summarise_lens
from entoscope.probing.intervals import (
    blocks_of,
    held_out_values,
    probing_stat,
    summarise_probing,
)
from entoscope.probing.predict import label_codes
from entoscope.stats import Stats

B = 2000  # resamples on both sides
PCT = Stats(n_boot=B, ci_method="expanded_percentile")
TOL = 0.15  # share of the interval width two independent bootstraps may differ by


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def expanded_levels(n: int, level: float = 0.95) -> tuple[float, float]:
    alpha = (1 - level) / 2
    if n < 6:
        return alpha, 1 - alpha
    a = float(sps.norm.cdf(np.sqrt(n / (n - 1)) * sps.t.ppf(alpha, n - 1)))
    return a, 1 - a


def brute_interval(values: np.ndarray, aggregate, seed: int = 12345) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """values [n, ...] per prompt; aggregate(rows) -> [...]: (low, high, bootstrap std) by resampling rows."""
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    with warnings.catch_warnings():  # a resample without any defined value is NaN, as in the code
        warnings.simplefilter("ignore", RuntimeWarning)
        boots = np.stack([aggregate(values[rng.integers(0, n, n)]) for _ in range(B)])
    lo, hi = expanded_levels(n)
    with np.errstate(invalid="ignore"):
        return np.nanquantile(boots, lo, axis=0), np.nanquantile(boots, hi, axis=0), np.nanstd(boots, 0, ddof=1)


def assert_close_intervals(low, high, ref_low, ref_high, abs_tol=1e-9):
    width = np.maximum(ref_high - ref_low, 0)
    allowed = TOL * width + abs_tol
    assert np.all(np.abs(low - ref_low) <= allowed), np.max(np.abs(low - ref_low) - allowed)
    assert np.all(np.abs(high - ref_high) <= allowed), np.max(np.abs(high - ref_high) - allowed)


def assert_inside(t: pd.DataFrame, name: str):
    v, lo, hi = (t[c].to_numpy(dtype=float) for c in (name, f"{name}_ci_low", f"{name}_ci_high"))
    ok = np.isfinite(lo)
    assert ok.any()
    assert np.all((lo[ok] <= v[ok] + 1e-12) & (v[ok] <= hi[ok] + 1e-12)), name


# ---------------------------------------------------------------------- lens
@pytest.fixture(scope="module")
def lens(demo):
    op = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions=[-1, -2]),
                 stats=PCT, seed=3)
    return op.run(demo, {"task": "ioi", "n": 12, "seed": 1}, quiet=True)


def test_lens_intervals_match_a_brute_force_bootstrap(lens):
    t, pp = lens.table, lens.per_prompt
    for agg, col in (("kl_mean", "kl_to_final"), ("target_prob_mean", "target_prob"),
                     ("target_logit_mean", "target_logit")):
        assert {f"{agg}_ci_low", f"{agg}_ci_high"} <= set(t.columns)
        values = pp.pivot(index="example", columns="site", values=col)[list(t["site"])].to_numpy()
        np.testing.assert_allclose(t[agg], values.mean(0), rtol=1e-12)
        low, high, _ = brute_interval(values, lambda v: v.mean(0))
        assert_close_intervals(t[f"{agg}_ci_low"].to_numpy(), t[f"{agg}_ci_high"].to_numpy(), low, high)
        assert_inside(t, agg)
    assert (t["ci_level"] == 0.95).all()


def test_lens_summary_is_deterministic_and_n_boot_zero_has_no_interval(lens):
    sites = lens.table[["site", "layer", "position"]].to_dict("records")
    again = summarise_lens(lens.per_prompt, sites, PCT, seed=3)
    pd.testing.assert_frame_equal(again, lens.table[again.columns])
    other = summarise_lens(lens.per_prompt, sites, PCT, seed=4)
    assert not np.allclose(other["kl_mean_ci_low"], again["kl_mean_ci_low"])
    none = summarise_lens(lens.per_prompt, sites, Stats(n_boot=0), seed=3)
    assert none["kl_mean_ci_low"].isna().all() and none["target_prob_mean_ci_high"].isna().all()
    np.testing.assert_allclose(none["kl_mean"], again["kl_mean"])


# ---------------------------------------------------------------------- DLA
@pytest.fixture(scope="module")
def dla(demo):
    return es.DirectLogitAttribution(stats=PCT, seed=5).run(demo, {"task": "ioi", "n": 16, "seed": 2}, quiet=True)


def bh(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values, written out: q_i = min over p_j >= p_i of p_j m / rank_j."""
    m = len(p)
    q = np.empty(m)
    for i in range(m):
        q[i] = min(1.0, min(p[j] * m / (np.sum(p <= p[j])) for j in range(m) if p[j] >= p[i]))
    return q


def test_dla_intervals_p_and_q_match_brute_force(dla):
    t, pp = dla.table, dla.per_prompt
    values = pp.pivot(index="example", columns="component", values="contribution")[list(t["component"])].to_numpy()
    np.testing.assert_allclose(t["mean"], values.mean(0), rtol=1e-12, atol=1e-15)
    low, high, sd = brute_interval(values, lambda v: v.mean(0))
    assert_close_intervals(t["mean_ci_low"].to_numpy(), t["mean_ci_high"].to_numpy(), low, high)
    np.testing.assert_allclose(t["mean_se"], sd, rtol=0.1)
    # p: the inversion of the interval, so p < 1 - level exactly where the interval at that level (the same
    # resamples) excludes 0; q: BH over the rows; significant: q <= fdr
    p, bound = t["mean_p"].to_numpy(), t["mean_p_bound"].to_numpy()
    for level in (0.8, 0.9, 0.95, 0.99):
        at = summarise_dla(dla.per_prompt, Stats(n_boot=B, ci_method="expanded_percentile", ci_level=level), seed=5)
        excludes = ((at["mean_ci_low"] > 0) | (at["mean_ci_high"] < 0)).to_numpy()
        exact = ~bound | (1 - level > p[bound].max(initial=0))
        np.testing.assert_array_equal((p < 1 - level)[exact], excludes[exact])
    np.testing.assert_allclose(t["mean_q"], bh(t["mean_p"].to_numpy()), rtol=1e-9)
    assert (t["significant"] == (t["mean_q"] <= 0.05)).all()
    assert_inside(t, "mean")


def test_dla_summary_deterministic_and_n_boot_zero(dla):
    again = summarise_dla(dla.per_prompt, PCT, seed=5)
    pd.testing.assert_frame_equal(again, dla.table, check_dtype=False)
    none = summarise_dla(dla.per_prompt, Stats(n_boot=0), seed=5)
    assert none[["mean_ci_low", "mean_ci_high", "mean_p", "mean_q"]].isna().all().all()
    assert not none["significant"].any()
    fig = dla.figures()[0][1]
    assert fig.data[0].error_x.arrayminus is not None  # asymmetric bars from the interval


# ---------------------------------------------------------------------- head scores
@pytest.fixture(scope="module")
def heads(demo):
    # half the prompts are prose without repeats: no duplicate-token target there (NaN, left out of score)
    data = es.data.Dataset("mixed", tuple(list(es.tasks.induction(n=6, seed=0)) + list(es.tasks.facts(n=6, seed=0))))
    op = es.HeadScores(kinds=["duplicate_token", "previous_token"], stats=PCT, seed=7)
    return op.run(demo, data, quiet=True)


def test_head_score_intervals_match_brute_force(heads):
    t, pp = heads.table, heads.per_prompt
    for kind, sub in t.groupby("kind", sort=False):
        rows = pp[pp["kind"] == kind]
        for col in ("score", "score_tl"):
            values = rows.pivot(index="example", columns="site", values=col)[list(sub["site"])].to_numpy()
            np.testing.assert_allclose(sub[col], np.nanmean(values, 0), rtol=1e-12)
            low, high, _ = brute_interval(values, lambda v: np.nanmean(v, 0))
            assert_close_intervals(sub[f"{col}_ci_low"].to_numpy(), sub[f"{col}_ci_high"].to_numpy(), low, high)
            assert_inside(sub, col)
            if col == "score":  # prompts without a target position are left out of `score`
                assert (sub["n_prompts"].to_numpy() == np.isfinite(values).sum(0)).all()


def test_head_scores_summary_deterministic_and_n_boot_zero(heads):
    again = summarise_head_scores(heads.per_prompt, PCT, seed=7)
    pd.testing.assert_frame_equal(again, heads.table, check_dtype=False)
    none = summarise_head_scores(heads.per_prompt, Stats(n_boot=0), seed=7)
    assert none[["score_ci_low", "score_tl_ci_high"]].isna().all().all()


# ---------------------------------------------------------------------- probing
@pytest.fixture(scope="module")
def probing(demo):
    op = es.Probing(sites=es.Sites(activation="resid_post", over=["layer"]), split="kfold", k=4, C_grid=[0.1, 1.0],
                    stats=PCT, seed=1)
    return op.run(demo, {"task": "ioi", "n": 16, "seed": 3}, quiet=True)


def test_probing_accuracy_interval_matches_brute_force_over_pooled_held_out_rows(probing):
    t, pp = probing.table, probing.per_prompt
    for site, row in t.set_index("site").iterrows():
        rows = pp[pp["site"] == site].sort_values("example")
        table = rows[["fold", "correct"]].to_numpy(dtype=float)  # every prompt held out once (k-fold)
        assert len(table) == 16

        def accuracy(v):  # the table's statistic: the mean over folds of each fold's accuracy
            return np.nanmean([v[v[:, 0] == f, 1].mean() if (v[:, 0] == f).any() else np.nan for f in range(4)])

        np.testing.assert_allclose(row["test_accuracy"], accuracy(table), rtol=1e-12)
        low, high, _ = brute_interval(table, accuracy)
        assert_close_intervals(np.array([row["test_accuracy_ci_low"]]), np.array([row["test_accuracy_ci_high"]]),
                               np.array([low]), np.array([high]), abs_tol=0.02)
    for name in ("test_accuracy", "test_f1_macro", "test_auroc", "selectivity", "control_test_accuracy"):
        assert_inside(t, name)


def test_probing_weighted_metrics_equal_sklearn_on_the_resampled_rows(demo):
    rng = np.random.default_rng(0)
    cases = [({"task": "ioi", "n": 32, "seed": 4}, {}),  # binary
             ({"task": "facts", "n": 32, "seed": 4}, {"labels": "meta.template"}),  # 4 classes
             ({"task": "greater_than", "n": 32, "seed": 4}, {"task": "regression"})]
    for data, kw in cases:
        op = es.Probing(sites=es.Sites(activation="resid_post", over=["layer"], layers=[1, 2]), split="kfold", k=4,
                        C_grid=[1.0], alpha_grid=[1.0], **kw)
        prepared = op.prepare_for(demo, data)
        result = op.execute(prepared, quiet=True)
        h = _held_out_from_result(prepared, result.extra["fit"])
        stat = probing_stat(h)
        value = stat(np.ones((1, stat.n)))[0]
        blocks = blocks_of(h)
        S = h.values.shape[0]
        table = result.table
        for j, name in enumerate(blocks):  # the statistic at weight 1 is the table's number
            np.testing.assert_allclose(value[j * S:(j + 1) * S], table[name].to_numpy(dtype=float), rtol=1e-9,
                                       atol=1e-12)
        for _ in range(3):
            counts = rng.multinomial(stat.n, np.full(stat.n, 1 / stat.n))
            got = stat(counts[None].astype(float))[0]
            expect = _sklearn_fold_mean(h, counts)
            for j, name in enumerate(blocks[:len(expect)]):
                np.testing.assert_allclose(got[j * S:(j + 1) * S], expect[name], rtol=1e-9, atol=1e-12)
        if data["task"] == "ioi":  # the same seed, the same intervals; another seed, others
            first, again = summarise_probing(h, PCT, 1), summarise_probing(h, PCT, 1)
            pd.testing.assert_frame_equal(first, again)
            assert not np.allclose(first["test_auroc_ci_low"], summarise_probing(h, PCT, 2)["test_auroc_ci_low"])


def _held_out_from_result(prepared, fit):
    from entoscope.probing.collect import collect

    st = prepared.state
    cs = st.cs
    collected = collect(prepared.model, st.batches, cs.units, cs.pool, cs.at, cs.head_pooling, len(cs.td),
                        metric=None, quiet=True)
    (F,) = collected.bucket_units
    return held_out_values(fit, collected.buckets[F], label_codes(fit, st.labels))


def _sklearn_fold_mean(h, counts):
    """Per metric [S]: the mean over folds of sklearn's metric on each fold's rows repeated `counts` times."""
    out = {}
    S = h.values.shape[0]
    for s in range(S):
        per_fold = {}
        for f in np.unique(h.fold):
            rows = np.flatnonzero(h.fold == f)
            rep = np.repeat(rows, counts[rows])
            if not rep.size:
                continue
            y, v = h.y[rep], h.values[s, rep]
            if h.n_classes is None:
                ms = {"test_r2": r2_score(y, v[:, 0]) if np.ptp(y) > 0 else np.nan,
                      "test_mse": mean_squared_error(y, v[:, 0])}
            else:
                K = h.n_classes
                if K == 2:
                    pred, score = (v[:, 0] > 0).astype(int), v[:, 0]
                    auc = roc_auc_score(y, score) if len(set(y)) == 2 else np.nan
                else:
                    pred = v.argmax(1)
                    p = np.exp(v - v.max(1, keepdims=True))
                    p /= p.sum(1, keepdims=True)
                    aucs = [roc_auc_score(y == k, p[:, k]) for k in range(K) if 0 < (y == k).sum() < len(y)]
                    auc = np.mean(aucs) if aucs else np.nan
                ms = {"test_accuracy": accuracy_score(y, pred),
                      "test_f1_macro": f1_score(y, pred, average="macro", labels=sorted(set(y) | set(pred))),
                      "test_auroc": auc}
            for k, val in ms.items():
                per_fold.setdefault(k, []).append(val)
        for k, vals in per_fold.items():
            out.setdefault(k, np.empty(S))[s] = np.nanmean(vals) if np.isfinite(vals).any() else np.nan
    return out


def test_probing_intervals_are_finite_and_drawn(probing):
    assert np.isfinite(probing.table["test_accuracy_ci_low"]).all()
    assert (probing.table["n_held_out"] == 16).all()
    fig = probing.figures()[0]
    assert "95% interval over held-out prompts" in fig[1].layout.yaxis.title.text  # the axis names its bars
    assert fig[1].data[0].error_y.arrayminus is not None


def test_probing_n_boot_zero_gives_no_interval(demo):
    op = es.Probing(sites=es.Sites(activation="resid_post", over=["layer"], layers=[2]), split="kfold", k=3,
                    C_grid=[1.0], stats=Stats(n_boot=0))
    t = op.run(demo, {"task": "ioi", "n": 12, "seed": 3}, quiet=True).table
    assert t[["test_accuracy_ci_low", "test_accuracy_ci_high", "selectivity_ci_low"]].isna().all().all()


def test_probing_split_too_small_is_refused_by_plan_as_by_run(demo):
    data = {"task": "ioi", "n": 4}
    op = es.Probing()
    with pytest.raises(es.EntoscopeError) as planned:
        op.plan(demo, data)
    with pytest.raises(es.EntoscopeError) as ran:
        op.run(demo, data, quiet=True)
    assert planned.value.code == ran.value.code == "probe_split_too_small"
    assert "0 validation" in str(planned.value) or "0 test" in str(planned.value)
