"""Words follow numbers at scale (docs/pages.md, "The false discovery control"): a table with no discovery
says whether its prompts could have given one, and names the cells whose intervals exclude zero as
candidates; checked against the table and the sign-flip test's limit written out here."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

import entoscope as es
from entoscope.patching.takeaway import patching_takeaway
from entoscope.results.claims import prompts_for_discovery


class _Result:
    def __init__(self, table: pd.DataFrame, fdr: float = 0.05) -> None:
        self.table, self.extra = table, {}
        self.manifest = {"config": {"stats": {"fdr": fdr}}}


def _table(n: int, m: int, shown: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    value = rng.normal(0, 0.1, m)
    low, high = value - 1.0, value + 1.0
    low[:shown], high[:shown], value[:shown] = 0.5, 1.2, 0.8  # intervals above 0
    return pd.DataFrame({"site": [f"a{i // 9}.h{i % 9}" for i in range(m)], "value": value, "value_ci_low": low,
                         "value_ci_high": high, "value_q": np.full(m, 0.14), "significant": False,
                         "value_fragile": False, "ci_level": 0.95, "n_prompts": n, "n_degenerate": 0})


def test_the_fewest_prompts_a_discovery_needs_is_the_sign_flip_limit():
    for m, fdr in ((270, 0.05), (70_651, 0.05), (12, 0.05), (1, 0.05), (300, 0.01)):
        n = prompts_for_discovery(m, fdr)
        assert 2.0 ** -(n - 1) <= fdr / m < 2.0 ** -(n - 2), (m, n)
    assert prompts_for_discovery(270, 0.05) == 14 and prompts_for_discovery(70_651, 0.05) == 22


def test_a_blind_grid_says_none_could_and_names_its_candidates():
    takeaway = patching_takeaway(_Result(_table(8, 270, 4)))
    text = str(takeaway)
    assert text.startswith("No cell survives the false discovery screen at a 5% rate (0 of 270 cells, "
                           "Benjamini-Hochberg). Over 8 prompts none could: among this many, one needs 14 "
                           "prompts or more")
    # the null is the lead, said as a null; why none could, and the candidates, are its details
    assert takeaway.lead == "No cell survives the false discovery screen at a 5% rate (0 of 270 cells, " \
        "Benjamini-Hochberg)."
    assert takeaway.details.startswith("Over 8 prompts none could")
    assert "4 of 270 cells have intervals that exclude zero: candidates, not findings" in text
    assert "differs from zero" not in text


def test_a_grid_that_could_have_shown_a_discovery_does_not_say_none_could():
    text = str(patching_takeaway(_Result(_table(32, 270, 0))))
    assert text.startswith("No cell survives the false discovery screen at a 5% rate (0 of 270 cells, "
                           "Benjamini-Hochberg). 0 of 270 cells have intervals that exclude zero")
    assert "none could" not in text


def test_on_the_demo_model_the_lead_counts_the_tables_candidates():
    r = es.Patching(sites={"activation": "z", "over": ["layer", "head"]}, stats={"fdr": 1e-4}).run(
        es.load_model("demo"), {"task": "ioi", "n": 8}, quiet=True)
    t = r.table
    assert not t["significant"].any()
    shown = int(((t["value_ci_low"] > 0) | (t["value_ci_high"] < 0)).sum())
    need = 1 + math.ceil(math.log2(len(t) / 1e-4))
    assert f"{shown} of {len(t)} cells have intervals that exclude zero" in r.takeaway
    assert f"Over 8 prompts none could: among this many, one needs {need} prompts" in r.takeaway
