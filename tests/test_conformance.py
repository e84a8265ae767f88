"""The conformance suite: every registered operation, on every model kind, held to one contract.

In the spirit of scikit-learn's estimator checks: each registered operation has a small case in
tests/conformance_cases.py (CASES), and every check below runs on every case and every model kind (a
plain and a compat TransformerBridge, a HookedTransformer where transformer-lens 3.x has one, an nnsight
LanguageModel where nnsight is installed, each also inside a CachedModel). A registered operation without
a case fails the suite. What a kind of model cannot run is declared in the case with the error code it
is refused with, and checked to be refused so (never skipped silently). docs/operations.md lists the
contract; the check functions live in conformance_cases.py and are shown here to fail on a broken
operation.
"""

from __future__ import annotations

import os

import pytest

import conformance_cases as cc
import entoscope as es
from entoscope.errors import EntoscopeError

# The fast core (default) runs every operation on a plain bridge, a HookedTransformer, an nnsight model and a
# CachedModel over the bridge; the other kinds are marked slow (CI runs them).
CORE_KINDS = ("bridge", "bridge+cached", "hooked", "nnsight")
PARAMS = [pytest.param(name, variant, kind, id=f"{name}-{variant or 'none'}-{kind}",
                       marks=() if kind in CORE_KINDS else pytest.mark.slow)
          for name, variant in cc.case_ids() for kind in cc.KINDS]
CACHED = [p for p in PARAMS if p.values[2].endswith("+cached")]

# Found by this suite in other branches' areas (kept failing here until they land; the lead removes the mark).


def _case(name: str, variant: str) -> cc.Case:
    case = cc.CASES.get(name, {}).get(variant)
    if case is None:
        pytest.fail(f"operation {name!r} is registered but has no case in tests/conformance_cases.py CASES: give it "
                    "a small config there (docs/operations.md, 'How an operation joins the conformance suite')")
    return case


def _usable(name: str, variant: str, kind: str) -> cc.Case:
    """The case, or a skip that says why this kind cannot run here or where its refusal is checked."""
    case = _case(name, variant)
    why = cc.unavailable(kind)
    if why:
        pytest.skip(why)
    refused = cc.refusal(case, case.family, kind)
    if refused:
        pytest.skip(f"declared refused ({refused[0]}: {refused[1]}); test_declared_refusals checks that it is")
    return case


_RUNS: dict[tuple[str, str, str], tuple[object, object, AssertionError | None]] = {}


def first_run(name: str, variant: str, kind: str) -> tuple[object, object, AssertionError | None]:
    """(model, result, the plan check's failure or None) of the case's first run on this kind, made once."""
    key = (name, variant, kind)
    if key not in _RUNS:
        case = _usable(name, variant, kind)
        model = cc.model_for(case.family, kind)
        try:
            result, failure = cc.check_plan_matches_run(case.op(0), model, case.dataset(), case.at_most), None
        except AssertionError as err:
            result, failure = case.op(0).run(model, case.dataset(), quiet=True), err
        _RUNS[key] = (model, result, failure)
    return _RUNS[key]


def test_every_registered_operation_has_a_case():
    missing = [n for n in es.registry.names("operation") if not cc.CASES.get(n)]
    assert not missing, f"registered operations without a conformance case: {missing}"
    stale = [n for n in cc.CASES if n not in es.registry.names("operation")]
    assert not stale, f"cases of operations no longer registered: {stale}"


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_the_plan_states_what_the_run_does(name, variant, kind):
    _, _, failure = first_run(name, variant, kind)
    if failure is not None:
        raise failure


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_preparing_again_runs_no_model(name, variant, kind):
    case = _usable(name, variant, kind)
    cc.check_prepare_runs_no_model(case.op(0), cc.model_for(case.family, kind), case.dataset())


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_a_seed_decides_every_random_choice(name, variant, kind):
    case = _usable(name, variant, kind)
    model, result, _ = first_run(name, variant, kind)
    cc.check_seed(case, lambda: model, result)  # a CachedModel: the same cache, now warm


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_a_saved_run_reads_back(name, variant, kind, tmp_path):
    _usable(name, variant, kind)
    cc.check_round_trip(first_run(name, variant, kind)[1], tmp_path / "run")


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_a_nan_weight_is_refused_naming_its_block(name, variant, kind):
    case = _usable(name, variant, kind)
    model, weight = cc.nan_weight_model(kind)
    cc.check_nan_refused(case.op(0), model, case.dataset() if case.family == "tiny" else cc.pairs())


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_every_aggregate_has_its_interval(name, variant, kind):
    case = _usable(name, variant, kind)
    cc.check_intervals(case, first_run(name, variant, kind)[1].table)


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_the_takeaway_names_only_rows_of_the_table(name, variant, kind):
    case = _usable(name, variant, kind)
    cc.check_takeaway(case, first_run(name, variant, kind)[1])


@pytest.mark.parametrize("name, variant, kind", PARAMS)
def test_one_shard_equals_one_batch_per_shard(name, variant, kind, tmp_path):
    case = _usable(name, variant, kind)
    if case.op(0).not_sharded_reason():
        pytest.skip(f"{name} ({variant}) is not sharded: {case.op(0).not_sharded_reason()}")
    model, result, _ = first_run(name, variant, kind)
    cc.check_shards(case, lambda: model, result, tmp_path / "shards")


@pytest.mark.parametrize("name, variant, kind", CACHED)
def test_a_cached_model_gives_the_plain_models_results(name, variant, kind):
    """Cold (every read computed and stored) and warm (the reads served from disk) equal the plain run."""
    case = _usable(name, variant, kind)
    plain = kind.removesuffix("+cached")
    expected = first_run(name, variant, plain)[1]
    model, cold, _ = first_run(name, variant, kind)
    cc.check_same_results(expected, cold, f"CachedModel over {plain} (cold) vs {plain}")
    before = model.cache_stats()
    warm = case.op(0).run(model, case.dataset(), quiet=True)
    cc.check_same_results(expected, warm, f"CachedModel over {plain} (warm) vs {plain}")
    after = model.cache_stats()
    if before["misses"]:  # the operation reads through run_with_cache: the warm run read from disk
        assert after["hits"] + after["subset_hits"] > before["hits"] + before["subset_hits"], after


REFUSALS = [pytest.param(name, variant, family, kind, id=f"{name}-{variant}-{family}-{kind}",
                         marks=() if kind in CORE_KINDS else pytest.mark.slow)
            for name, variant in cc.case_ids() if cc.CASES.get(name, {}).get(variant)
            for family in ("tiny", "demo") for kind in cc.KINDS
            if cc.refusal(cc.CASES[name][variant], family, kind)
            and (family == cc.CASES[name][variant].family or family in cc.CASES[name][variant].refused)]


@pytest.mark.parametrize("name, variant, family, kind", REFUSALS)
def test_declared_refusals(name, variant, family, kind):
    """What a case declares a model kind cannot run is refused, before any work, with the declared code."""
    if cc.unavailable(kind):
        pytest.skip(cc.unavailable(kind))
    case = cc.CASES[name][variant]
    code, why = cc.refusal(case, family, kind)
    data = case.dataset() if family == case.family or case.data is None else cc.pairs()
    for call in ("plan", "run"):
        with pytest.raises(EntoscopeError) as err:
            model = cc.model_for(family, kind)
            getattr(case.op(0), call)(model, data, **({"quiet": True} if call == "run" else {}))
        assert err.value.code == code, f"{call}: refused with {err.value.code!r}, declared {code!r} ({why})"


# ------------------------------------------------------------------ the checks fail a broken operation
class UnderCountingLens(es.Lens):
    """A lens whose plan says one forward pass fewer than its run makes."""

    name = "broken_lens"

    def prepare(self, model, data):
        prepared = super().prepare(model, data)
        prepared.plan.forward_passes -= 1
        return prepared


@pytest.fixture()
def broken_registered(monkeypatch):
    """UnderCountingLens registered as an operation for this test only."""
    from entoscope import registry

    monkeypatch.setitem(registry._REGISTRY["operation"], "broken_lens", UnderCountingLens)
    return UnderCountingLens


def test_a_plan_that_under_counts_fails_the_suite(broken_registered):
    assert "broken_lens" in es.registry.names("operation")
    with pytest.raises(pytest.fail.Exception, match="no case"):  # registered without a case: the suite fails it
        _case("broken_lens", "")
    model, data = cc.model_for("tiny", "bridge"), cc.pairs()
    with pytest.raises(AssertionError, match="forward_passes"):
        cc.check_plan_matches_run(broken_registered(batch_size=4), model, data)
    cc.check_plan_matches_run(es.Lens(batch_size=4), model, data)  # the same check passes the honest lens


def test_the_other_checks_fail_what_breaks_them():
    """Each check raises on a result that breaks its rule (a table changed by hand), and passes the original."""
    case = cc.CASES["dla"]["default"]
    _, result, _ = first_run("dla", "default", "bridge")
    cc.check_intervals(case, result.table)
    with pytest.raises(AssertionError, match="without"):
        cc.check_intervals(case, result.table.drop(columns=["mean_ci_low"]))
    cc.check_takeaway(case, result)
    shifted = type("R", (), {"operation": "dla", "takeaway": result.takeaway + " Also a7.h9 writes.",
                              "table": result.table})()
    with pytest.raises(AssertionError, match="no rows"):
        cc.check_takeaway(case, shifted)
    other = type("R", (), {"table": result.table.assign(mean=result.table["mean"] + 1e-12),
                           "per_prompt": result.per_prompt})()
    with pytest.raises(AssertionError):
        cc.check_same_results(result, other, "changed")


def test_the_pass_counter_counts_a_hand_written_run():
    """The counter against runs made by hand: a batch of 3 and a batch of 2 through the blocks (5 prompt
    forwards), one backward of the batch of 2, and a run that starts at block 1."""
    import torch

    from entoscope.models.adapter import adapt

    model = cc.plain_model("tiny", "bridge")
    tl = adapt(model).module
    tokens = torch.randint(1, 300, (3, 6))
    with cc.PassCounter(model) as counted:
        with torch.no_grad():
            tl(tokens)
        _, cache = tl.run_with_cache(tokens[:2], names_filter=["blocks.1.hook_resid_pre"])
        h = cache["blocks.1.hook_resid_pre"].detach().requires_grad_(True)
        out = tl.blocks[1](h)  # a pass that starts at block 1, differentiated
        torch.autograd.grad((out[0] if isinstance(out, tuple) else out).sum(), [h])
    assert counted.passes == [3, 2, 2], counted.passes
    assert counted.forwards == 7 and counted.backwards == 2


def test_the_nnsight_kind_is_required_in_ci():
    if os.environ.get("ENTOSCOPE_REQUIRE_NNSIGHT") == "1":
        assert not cc.unavailable("nnsight")
    else:
        pytest.skip("ENTOSCOPE_REQUIRE_NNSIGHT is not set (CI sets it)")
