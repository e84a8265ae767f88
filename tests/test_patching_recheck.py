"""Attribution's top cells re-checked by exact patching (patching/recheck.py): the re-check's exact values and
intervals are those of an exact run over the whole grid (an independent run: every cell, no selection), its
estimates are the attribution table's top |value| rows, `outside_range` is the estimate outside [0, 1] and
`held` the exact interval excluding 0 on the estimate's side, recomputed here from the columns."""

from __future__ import annotations

import numpy as np
import pytest

import entoscope as es
from entoscope.patching.recheck import recheck_operation, recheck_table

DATA = {"task": "ioi", "n": 12, "seed": 7}
ROLES = ["IO", "S1", "S1+1", "S2", "S2+1", "END"]


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.mark.parametrize("sites", [{"activation": "resid_pre", "over": ["layer", "position"], "positions": ROLES},
                                   {"activation": "z", "over": ["layer", "head"]},
                                   {"activation": "mlp_out", "over": ["layer", "position"], "positions": "-3:"}],
                         ids=["resid_roles", "heads", "mlp_from_end"])
def test_the_recheck_is_the_exact_grids_value_at_attributions_top_cells(demo, sites):
    op = es.Patching(sites=sites, metric="logit_diff", method="attribution")
    screen = op.run(demo, DATA, quiet=True).table
    again = recheck_operation(op, screen, 4)
    assert again.method == "exact" and again.metric == op.metric
    recheck = recheck_table(screen, again.run(demo, DATA, quiet=True).table, 4)
    full = es.Patching(sites=sites, metric="logit_diff", method="exact").run(demo, DATA, quiet=True).table
    full = full.set_index("site")
    top = screen.iloc[np.argsort(-screen["value"].abs().to_numpy(), kind="stable")[:4]]
    assert list(recheck["site"]) == list(top["site"])
    assert recheck["estimate"].to_numpy() == pytest.approx(top["value"].to_numpy())
    for col in ("value", "value_ci_low", "value_ci_high"):
        assert recheck[col].to_numpy() == pytest.approx(full.loc[recheck["site"], col].to_numpy(), abs=1e-6)
    estimate = recheck["estimate"].to_numpy()
    assert list(recheck["outside_range"]) == list((estimate < 0) | (estimate > 1))
    low, high = recheck["value_ci_low"].to_numpy(), recheck["value_ci_high"].to_numpy()
    assert list(recheck["held"]) == [lo > 0 if e >= 0 else hi < 0 for e, lo, hi in zip(estimate, low, high)]


def test_a_grid_of_groups_is_not_rechecked(demo):
    op = es.Patching(sites={"activation": "z", "groups": [[{"layer": 2, "head": 0}, {"layer": 2, "head": 1}]]},
                     metric="logit_diff", method="attribution")
    screen = op.run(demo, DATA, quiet=True).table
    assert recheck_operation(op, screen, 4) is None
