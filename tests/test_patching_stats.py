"""Dataset-level patching numbers: the report's headline cells are not carried by one pair, the interval
and influence columns equal brute-force computations over the per-prompt table."""

from __future__ import annotations

import numpy as np
import pytest

import entoscope as es
from entoscope.report.sections.patching import _examples
from entoscope.stats import resample_weights
from entoscope.stats.bootstrap import expanded_alpha


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.mark.parametrize("example", [0, 1], ids=["ioi-resid-by-role", "ioi-heads"])
def test_report_headline_cells_are_not_carried_by_one_pair(demo, example):
    """Every cell of the report's IOI tables either moves by less than half its size (of at least 10% of
    the table's largest) when its most influential pair is left out, or is flagged fragile AND its
    interval includes 0, so no single pair decides a reported effect."""
    title, config, data = _examples(demo, quick=False)[example]
    t = es.Patching(**config).run(demo, data, quiet=True).table
    scale = np.abs(t.value).max()
    moved = t.value_influence / np.maximum(np.abs(t.value), 0.1 * scale)
    supported = moved <= 0.5
    assert ((supported & ~t.value_fragile) | (t.value_fragile & (t.value_ci_low <= 0) & (0 <= t.value_ci_high))).all()
    assert (supported == ~t.value_fragile).all()
    assert supported[t.significant].all()  # no reported (significant) effect rests on one pair
    assert t.significant.any()


def test_intervals_and_influence_equal_brute_force_over_the_per_prompt_table(demo):
    data = es.tasks.ioi(n=12, seed=9)
    op = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions=["S2", "END"]),
                     stats={"n_boot": 400, "ci_method": "expanded_percentile"}, seed=3)
    r = op.run(demo, data, quiet=True)
    pp = r.per_prompt
    for site, rows in pp.groupby("site", sort=False):
        rows = rows.sort_values("example")
        P, B, S = (rows[c].to_numpy(float) for c in ("patched_metric", "base_metric", "source_metric"))

        def ratio(i):
            return (P[i].mean() - B[i].mean()) / (S[i].mean() - B[i].mean())
        n = len(P)
        row = r.table.set_index("site").loc[site]
        assert row.value == pytest.approx(ratio(np.arange(n)), abs=1e-9)
        loo = np.array([ratio(np.delete(np.arange(n), i)) for i in range(n)])
        assert row.value_influence == pytest.approx(np.abs(loo - row.value).max(), abs=1e-9)
        assert row.value_influential_prompt == np.abs(loo - row.value).argmax()
        W = resample_weights(n, 400, 3)
        boots = np.array([ratio(np.repeat(np.arange(n), w.astype(int))) for w in W])
        a = expanded_alpha(0.95, n)
        assert row.value_ci_low == pytest.approx(np.quantile(boots, a), abs=1e-9)
        assert row.value_ci_high == pytest.approx(np.quantile(boots, 1 - a), abs=1e-9)


def test_a_pair_with_a_small_gap_is_degenerate_relative_to_the_dataset(demo):
    data = es.tasks.ioi(n=16, seed=2)
    r = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"]), stats={"n_boot": 0}).run(demo, data,
                                                                                                    quiet=True)
    gaps = np.abs(r.extra["m_source"].numpy() - r.extra["m_base"].numpy())
    expected = gaps < 0.1 * np.median(gaps)
    np.testing.assert_array_equal(r.extra["degenerate"], expected)
    assert r.table.n_degenerate.iloc[0] == expected.sum()
