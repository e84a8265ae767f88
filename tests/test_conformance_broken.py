"""The conformance suite catches a broken operation: real registered operations, each broken in one way.

Each broken operation is a subclass of a registered one (never registered itself) that gets one thing of
the contract wrong: its plan under-counts the forward passes, or over-counts the backward passes, its
takeaway names a row the table does not have, or its table drops an aggregate's interval columns. It is
run through the same check functions tests/test_conformance.py runs on every registered operation
(tests/conformance_cases.py), and must fail the check of what it breaks, and only that one, while the
unbroken operation passes them all. On the tiny 2-layer GPT-2 on a plain TransformerBridge, as the suite's
cases of these operations run.
"""

from __future__ import annotations

import dataclasses

import pytest

import conformance_cases as cc
import entoscope as es
from entoscope.circuits.scores_takeaway import dla_takeaway


class UnderCountingDLA(es.DirectLogitAttribution):
    """Its plan reports one prompt forward fewer than its run makes."""

    def prepare(self, model, data):
        prepared = super().prepare(model, data)
        prepared.plan.forward_passes -= 1
        return prepared


class StrayTakeawayDLA(es.DirectLogitAttribution):
    """Its takeaway also names a head of the layer after the last (a row the table cannot have)."""

    def summarise(self, prepared, merged, *, quiet=False):
        result = super().summarise(prepared, merged, quiet=quiet)
        past_last = int(result.table["layer"].max()) + 1
        result._takeaway = lambda r: f"{dla_takeaway(r)} Head a{past_last}.h0 adds to it."
        return result


class NoIntervalDLA(es.DirectLogitAttribution):
    """Its table gives the aggregate `mean` without mean_ci_low / mean_ci_high."""

    def summarise(self, prepared, merged, *, quiet=False):
        result = super().summarise(prepared, merged, quiet=quiet)
        result.table = result.table.drop(columns=["mean_ci_low", "mean_ci_high"])
        return result


class OverCountingAttribution(es.Patching):
    """Its plan reports one prompt backward more than its run makes."""

    def prepare(self, model, data):
        prepared = super().prepare(model, data)
        prepared.plan.backward_passes += 1
        return prepared


def _case_of(name: str, variant: str, cls: type | None) -> cc.Case:
    """The suite's own case of the operation, its config made as an instance of `cls` (None: the operation)."""
    case = cc.CASES[name][variant]
    if cls is None:
        return case
    return dataclasses.replace(case, make=lambda seed: cls(**case.op(seed).model_dump()))


def failed_checks(case: cc.Case) -> dict[str, str]:
    """check name -> its AssertionError, for the plan, interval and takeaway checks of the suite on the case."""
    model, data = cc.model_for(case.family, "bridge"), case.dataset()
    failed = {}
    try:
        result = cc.check_plan_matches_run(case.op(0), model, data, case.at_most)
    except AssertionError as err:
        failed["plan"] = str(err)
        result = case.op(0).run(model, data, quiet=True)
    for name, check in (("intervals", lambda: cc.check_intervals(case, result.table)),
                        ("takeaway", lambda: cc.check_takeaway(case, result))):
        try:
            check()
        except AssertionError as err:
            failed[name] = str(err)
    return failed


@pytest.mark.parametrize("name, variant", [("dla", "default"), ("patching", "attribution")])
def test_the_unbroken_operation_passes(name, variant):
    assert failed_checks(_case_of(name, variant, None)) == {}


@pytest.mark.parametrize("name, variant, broken, check, says", [
    ("dla", "default", UnderCountingDLA, "plan", "forward_passes"),
    ("dla", "default", StrayTakeawayDLA, "takeaway", "a2.h0"),
    ("dla", "default", NoIntervalDLA, "intervals", "'mean'"),
    ("patching", "attribution", OverCountingAttribution, "plan", "backward_passes"),
], ids=["under-counted-forwards", "takeaway-names-no-row", "aggregate-without-interval", "over-counted-backwards"])
def test_a_broken_operation_fails_the_check_of_what_it_breaks(name, variant, broken, check, says):
    case = _case_of(name, variant, broken)
    assert type(case.op(0)) is broken and es.registry.lookup("operation", name) is not broken  # never registered
    failed = failed_checks(case)
    assert set(failed) == {check}, f"{broken.__name__}: expected only the {check} check to fail, got {failed}"
    assert says in failed[check], failed[check]
