"""Confirmation on held-out prompts (confirm.py, docs/statistics.md "Confirmation"): the screen's top k cells
re-tested on fresh prompts of the same task; checked against runs made by hand on those prompts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import entoscope as es
from entoscope.confirm import SEED_STEP
from entoscope.errors import ConfigError
from entoscope.stats import benjamini_hochberg


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_patching_confirms_its_top_cells_on_fresh_prompts(demo, tmp_path):
    sites = {"activation": "z", "over": ["layer", "head"]}
    r = es.Patching(sites=sites, confirm={"k": 4, "n": 16}).run(demo, {"task": "ioi", "n": 12, "seed": 3}, quiet=True)
    c = r.confirmation
    t = r.table
    top = t.sort_values(["value_p", "value"], key=lambda s: s if s.name == "value_p" else -s.abs(), kind="stable")
    assert list(c["site"]) == list(top["site"][:4])  # smallest p, then largest |value|
    np.testing.assert_allclose(c["screen_value"], top["value"][:4])
    # the fresh prompts by hand: the same task with seed 3 + SEED_STEP, every head (the confirmation patches 4)
    fresh = es.Patching(sites=sites).run(demo, {"task": "ioi", "n": 16, "seed": 3 + SEED_STEP}, quiet=True).table
    fresh = fresh.set_index("site").loc[c["site"]]
    np.testing.assert_allclose(c["value"], fresh["value"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(c["value_ci_low"], fresh["value_ci_low"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(c["value_q"], benjamini_hochberg(c["value_p"].to_numpy()))  # over k, not m
    assert (c["n_prompts"] == 16).all() and (c["screen_n_prompts"] == 12).all()
    assert list(c["confirmed"]) == list(c["value_q"] <= 0.05)
    r.save(tmp_path / "run")
    saved = pd.read_csv(tmp_path / "run" / "confirmation.csv")
    assert list(saved["site"]) == list(c["site"])
    page = (tmp_path / "run" / "index.html").read_text()
    assert page.count(">confirmation on fresh prompts</h2>") == 1  # its note and its table under one heading


def test_dla_confirms_on_fresh_prompts(demo):
    r = es.DirectLogitAttribution(metric="logit_diff", confirm={"k": 3}).run(demo, {"task": "ioi", "n": 12}, quiet=True)
    fresh = es.DirectLogitAttribution(metric="logit_diff").run(demo, {"task": "ioi", "n": 12, "seed": SEED_STEP},
                                                              quiet=True).table.set_index("component")
    c = r.confirmation
    np.testing.assert_allclose(c["mean"], fresh.loc[c["component"], "mean"], rtol=1e-9)
    np.testing.assert_allclose(c["mean_p"], fresh.loc[c["component"], "mean_p"], rtol=1e-9)


def test_confirmation_is_refused_before_the_run_where_it_cannot_be_made(demo):
    from entoscope.data import Dataset

    own = Dataset("mine", tuple(es.tasks.ioi(n=4).examples))  # a user's own prompts: no task to draw fresh ones from
    with pytest.raises(ConfigError) as err:
        es.Patching(confirm={"k": 2}).run(demo, own, quiet=True)
    assert err.value.code == "confirm_needs_task"
    with pytest.raises(ConfigError) as err:
        es.Lens(sites={"activation": "resid_post", "over": ["layer"]}, confirm={"k": 2}).run(
            demo, {"task": "ioi", "n": 4}, quiet=True)
    assert err.value.code == "confirm_unsupported"


def test_the_switch_is_in_yaml_and_the_cli(tmp_path):
    from entoscope.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("dla_confirmed:\n  operation: dla\n  data: {task: ioi, n: 8}\n  metric: logit_diff\n"
                      "  confirm: {k: 2, n: 8}\n")
    assert main(["run", str(config), "dla_confirmed", "--model", "demo", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert len(pd.read_csv(next((tmp_path / "a").rglob("confirmation.csv")))) == 2
    assert main(["dla", "--data", "{task: ioi, n: 8}", "--metric", "logit_diff", "--confirm", "{k: 3}",
                 "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert len(pd.read_csv(tmp_path / "b" / "confirmation.csv")) == 3


def test_circuit_edges_confirm_on_fresh_prompts(demo):
    op = es.Circuits(method="eap", n_edges=10, faithfulness=[])
    r = es.Circuits(method="eap", n_edges=10, faithfulness=[], confirm={"k": 3}).run(
        demo, {"task": "induction", "n": 8}, quiet=True)
    fresh = op.run(demo, {"task": "induction", "n": 8, "seed": SEED_STEP}, quiet=True).table.set_index("edge")
    c = r.confirmation
    np.testing.assert_allclose(c["score"], fresh.loc[c["edge"], "score"], rtol=1e-9)
    assert (c["screen_n_prompts"] == 8).all() and (c["n_prompts"] == 8).all()


def test_a_built_in_tasks_dataset_confirms_as_its_spec_does(demo):
    """es.tasks.ioi(n=12) carries how it was made (its params), so its fresh prompts are those of the spec."""
    from_dataset = es.DirectLogitAttribution(metric="logit_diff", confirm={"k": 3}).run(
        demo, es.tasks.ioi(n=12), quiet=True).confirmation
    from_spec = es.DirectLogitAttribution(metric="logit_diff", confirm={"k": 3}).run(
        demo, {"task": "ioi", "n": 12}, quiet=True).confirmation
    np.testing.assert_array_equal(from_dataset["component"].to_numpy(), from_spec["component"].to_numpy())
    np.testing.assert_allclose(from_dataset["mean"], from_spec["mean"], rtol=1e-12)
