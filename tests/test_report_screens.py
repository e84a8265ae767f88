"""No section's screen is blind at the report's own sizes (report/sizes.py, docs/report.md): every run whose table
tests its cells against 0 gets prompts enough that a cell can be a discovery on its own with room to spare.

The check is independent of the sizing code: the cells are the rows of the run's own plan, the prompts its
data's, and a cell's smallest p is the sign-flip test's, 2^-(n-1) on n prompts (every prompt's value of one
sign: the data's sign pattern and its negation are the only ones as extreme, Fisher 1935) or, above 24
prompts, the Monte Carlo resolution 1 / (flips + 1); Benjamini-Hochberg at fdr makes a cell alone a discovery
when p m <= fdr."""

from __future__ import annotations

import json
import math
import warnings

import pytest

import entoscope as es
from entoscope.registry import lookup
from entoscope.report import SECTION_ORDER
from entoscope.report import sizes as sizes_module


def _smallest_p(n: int, cells: int, fdr: float) -> float:
    exact = 2.0 ** -(n - 1)
    if n <= 24:
        return exact
    flips = min(1_000_000, max(20_000, math.ceil(10 * cells / fdr)))  # stats/signflip.py flips_for: its resolution
    return max(exact, 1.0 / (flips + 1))


def _screened_runs(model, quick):
    """(section, operation, prompts, cells, fdr) of every run of the report's sections that tests its cells."""
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in SECTION_ORDER:
            runs = getattr(lookup("report_section", name), "runs", None)
            for op, data in (runs(model, quick) if runs else []):
                if op.tests_cells:
                    plan = op.prepare_for(model, data).plan
                    out.append((name, op.name, int(data["n"]), plan.examples, plan.rows, op.stats.fdr))
    blind = [str(w.message) for w in caught if getattr(w.message, "code", "") == "screen_blind"]
    return out, blind


def _check(model, quick):
    runs, blind = _screened_runs(model, quick)
    assert runs and blind == []
    for section, op, n, examples, cells, fdr in runs:
        assert examples == n
        q_alone = _smallest_p(n, cells, fdr) * cells
        assert q_alone <= fdr / sizes_module.SCREEN_HEADROOM, (section, op, n, cells, q_alone)
    return runs


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_demo_screens_can_discover_at_the_reports_sizes(demo, quick):
    runs = _check(demo, quick)
    if quick:  # the table's 8 prompts were blind for the demo's 36 head scores (2^-7 x 36 = 0.28 > 0.05)
        n = {section: n for section, _, n, _, _, _ in runs}
        assert n["head_scores"] > 8 and n["dla"] > 8 and n["patching"] > 8


def test_the_manifests_record_is_what_the_runs_plans_show(demo):
    """The demo counted as a large model: the same cells, the large tier's table; the manifest's record
    gives each screen's cells, prompts and smallest q, as the runs' own plans have them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizes_module, "SMALL_MACS", 0.0)
        runs = _check(demo, True)
        found = {(s["operation"], s["cells"]): s for name in SECTION_ORDER
                 for s in sizes_module.screens(demo, name, True)}
    for section, op, n, _, cells, fdr in runs:
        record = found[(op, cells)]
        assert record["prompts"] == n and not record["blind"] and "limited" not in record
        assert record["min_q_alone"] == pytest.approx(_smallest_p(n, cells, fdr) * cells)


def test_a_budget_too_small_keeps_the_tables_prompts_and_says_why_on_the_page(demo, tmp_path):
    from entoscope.report import build_report

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizes_module, "SCREEN_BUDGET", {True: 1.0, False: 1.0})
        build_report(demo, tmp_path / "r", quick=True, sections=["dla"], quiet=True)
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    [record] = manifest["screens"]["dla"]
    assert record["prompts"] == 8 == json.loads((tmp_path / "r" / "dla" / "manifest.json").read_text())["data"]["n"]
    assert "buys 8" in record["limited"]
    page = (tmp_path / "r" / "index.html").read_text()
    assert "This section screens 20 cells (dla) on 8 prompts, fewer than its screen needs" in page


@pytest.mark.slow
def test_the_demo_report_warns_no_screen_blind(demo, tmp_path):
    """Every run the quick report makes, the circuits section's routes included: none records screen_blind."""
    from entoscope.report import build_report

    build_report(demo, tmp_path / "r", quick=True, quiet=True)
    codes = [w["code"] for m in (tmp_path / "r").rglob("manifest.json")
             for w in json.loads(m.read_text()).get("warnings", []) + json.loads(m.read_text()).get(
                 "confirmation", {}).get("warnings", [])]
    assert codes.count("screen_blind") == 0, codes


@pytest.mark.real
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_real_screens_can_discover_at_the_reports_sizes(real_folder, quick):
    model = es.load_model(str(real_folder))
    runs = _check(model, quick)
    assert {section for section, *_ in runs} >= {"head_scores", "dla", "patching", "circuits"}
