"""The report's steering section on the demo model: a material effect (its interval beyond 5% of the unsteered
metric) at some coefficient in units of the residual's norm, a direction that beats its random baseline there, and side effects with intervals, checked from the saved tables
(the interval of direction - random recomputed here from the per-prompt table with a plain numpy bootstrap)."""

import numpy as np
import pandas as pd

import entoscope as es
from entoscope.report.sections.steering import steering_section


def test_the_steering_section_shows_an_effect_that_beats_its_random_baseline_with_side_effects(tmp_path):
    model = es.load_model("demo")
    from entoscope.results.page import ensure_plotly_js

    ensure_plotly_js(tmp_path)
    section = steering_section(model, tmp_path / "steering", quick=True)
    table = pd.read_parquet(tmp_path / "steering" / "table.parquet")
    pp = pd.read_parquet(tmp_path / "steering" / "per_prompt.parquet")
    band = 0.05 * abs(float(table.metric_unsteered.iloc[0]))  # docs/pages.md: material = the interval beyond 5% of the unsteered
    steered = table[table.direction == "direction"]
    shown = steered[(steered.effect_ci_low > band) | (steered.effect_ci_high < -band)]
    assert len(shown) > 0  # a material effect on the demo model
    c = shown.iloc[np.argmin(np.abs(shown.coefficient.to_numpy()))].coefficient
    R = float(table.residual_norm.iloc[0])  # the coefficients' unit: the site's mean norm (steering/scale.py)
    assert table.written_norm.to_numpy() == __import__("pytest").approx(np.abs(table.coefficient.to_numpy()) * R)
    task = pp[pp.set == "task"]
    d = task[(task.direction == "direction") & (task.coefficient == c)].sort_values("example").metric.to_numpy()
    r = task[(task.direction == "random") & (task.coefficient == c)].sort_values("example").metric.to_numpy()
    diff = d - r
    rng = np.random.default_rng(0)
    boot = np.array([diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)])
    low, high = np.quantile(boot, [0.025, 0.975])
    effect = float(table[(table.direction == "direction") & (table.coefficient == c)].effect.iloc[0])
    assert (low > 0 or high < 0) and np.sign(low) == np.sign(effect)  # direction beats random, on the effect's side
    row = table[(table.direction == "direction") & (table.coefficient == c)].iloc[0]
    assert bool(row.beats_random)
    assert row.minus_random == np.float64(diff.mean()) or abs(row.minus_random - diff.mean()) < 1e-12
    for col in ("kl", "loss_change", "ioi_change", "greater_than_change"):
        assert np.isfinite([row[col], row[col + "_ci_low"], row[col + "_ci_high"]]).all(), col
    held = pp[(pp.set != "task") & (pp.direction == "direction") & (pp.coefficient == c)]
    assert abs(held.kl.mean() - row.kl) < 1e-12 and row.kl > 0 and row.n_held_out == len(held)
    assert f"c = {c:g}" in section.lead and "KL(steered || unsteered)" in section.lead
    assert "smallest coefficient with a material effect" in section.lead
    lead = section.lead.split(" That is,")[0]  # the lead itself names the random baseline and the difference
    assert "(direction minus random " in lead and "the direction beats its random baseline there" in lead
    page = (tmp_path / "steering" / "index.html").read_text()
    assert "dose-response" in page and "continuations" in page
