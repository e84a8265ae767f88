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


def _facts_texts(demo) -> set[str]:
    """Every prompt the facts task can write under the demo's tokenizer, listed here from its vocabulary and
    templates (a country and capital kept where each is one token after a space, as the task's docstring says)."""
    from entoscope.data.tasks import vocab
    from entoscope.data.tasks.facts import TEMPLATES

    tok = demo.tokenizer
    one = lambda w: len(tok.encode(" " + w, add_special_tokens=False)) == 1  # noqa: E731
    return {t.format(country=c) for c, cap in vocab.COUNTRIES if one(c) and one(cap) for t in TEMPLATES}


def test_fresh_prompts_are_none_of_the_screens_and_never_repeat_and_a_small_task_is_capped(demo):
    """facts writes only |countries| x 4 templates prompts (128 on the demo): confirm n 1000 asked of it runs on
    every one the screen did not use, each once, says so (confirm_fresh_capped, the note's count) and lists
    them in the manifest."""
    import warnings as w

    from entoscope.errors import EntoscopeWarning

    texts = _facts_texts(demo)
    assert len(texts) == 128
    data = {"task": "facts", "n": 24, "seed": 1}
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        r = es.DirectLogitAttribution(metric="logit_diff", confirm={"k": 2, "n": 1000}).run(demo, data, quiet=True)
    screen = {rec["prompt"] for rec in r.manifest["data"]["records"]}
    fresh = [rec["prompt"] for rec in r.manifest["confirmation"]["records"]]
    assert len(set(fresh)) == len(fresh)  # none twice
    assert not set(fresh) & screen  # none of the screen's
    assert set(fresh) == texts - screen  # every other prompt the task can write
    n = len(texts - screen)
    assert (r.confirmation["n_prompts"] == n).all()
    assert f"confirmation on {n} fresh prompts" in r.notes[-1][1]
    capped = [x for x in r.warnings if x["code"] == "confirm_fresh_capped"]
    assert len(capped) == 1 and f"makes only {n}" in capped[0]["message"] and "1000" in capped[0]["message"]
    assert any(isinstance(c.message, EntoscopeWarning) and "confirm_fresh_capped" in str(c.message) for c in caught)
    with pytest.raises(es.EntoscopeError) as err:  # the screen took every prompt: nothing is left to confirm on
        es.DirectLogitAttribution(metric="logit_diff", confirm={"k": 2}).plan(demo, {"task": "facts", "n": 2000})
    assert err.value.code == "confirm_no_fresh"


def test_confirm_without_p_values_is_refused_before_the_run(demo):
    """stats.n_boot 0 makes no p anywhere, so a confirmation would test nothing: refused by plan() and run()
    before any forward (it said "0 of 2 confirmed at a 5% false discovery rate")."""
    op = es.DirectLogitAttribution(metric="logit_diff", stats={"n_boot": 0}, confirm={"k": 2})
    for call in (op.plan, lambda m, d: op.run(m, d, quiet=True)):
        with pytest.raises(ConfigError) as err:
            call(demo, {"task": "ioi", "n": 8})
        assert err.value.code == "confirm_no_test"
    from entoscope.confirm import confirmation_note

    table = pd.DataFrame({"component": ["a0.h0"], "screen_mean_p": [np.nan], "mean_p": [np.nan],
                          "confirmed": [False], "n_prompts": [8]})
    assert "no test was made" in confirmation_note(table, 0.05)  # a confirmation whose fresh p are all missing


def test_the_plan_counts_the_confirmations_passes(demo):
    """plan() with confirm adds the confirmation run's passes: the same operation planned on the fresh prompts
    by hand (head scores and DLA run their grid again; patching its k sites, here the first k of the grid)."""
    data = {"task": "induction", "n": 8, "seed": 2}
    fresh = {"task": "induction", "n": 6, "seed": 2 + SEED_STEP}
    screen = es.HeadScores().plan(demo, data)
    both = es.HeadScores(confirm={"k": 3, "n": 6}).plan(demo, data)
    alone = es.HeadScores().plan(demo, fresh)
    assert alone.forward_passes > 0
    assert both.forward_passes == screen.forward_passes + alone.forward_passes
    assert both.backward_passes == screen.backward_passes + alone.backward_passes
    assert any(n.startswith("confirm: the screen's top 3 cells again on 6 fresh prompts") for n in both.notes)
    sites = {"activation": "z", "over": ["layer", "head"]}
    ioi = {"task": "ioi", "n": 8, "seed": 3}
    first3 = {"activation": "z", "over": ["layer", "head"], "coords": [{"layer": 0, "head": h} for h in range(3)]}
    p_screen = es.Patching(sites=sites).plan(demo, ioi)
    p_both = es.Patching(sites=sites, confirm={"k": 3}).plan(demo, ioi)
    p_alone = es.Patching(sites=first3).plan(demo, {"task": "ioi", "n": 8, "seed": 3 + SEED_STEP})
    assert p_both.forward_passes == p_screen.forward_passes + p_alone.forward_passes
