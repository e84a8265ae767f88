"""The memory budget (memory.py, docs/memory.md): sizes read as a person writes them, batches sized to the budget,
a run that cannot fit refused before any forward naming the smallest budget that would do, and (real models, in a
fresh process) a forced budget held and the plan's peak within 25% of the measured one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import entoscope as es
from entoscope.errors import ConfigError, EntoscopeError
from entoscope.memory import MemoryBudgetError, parse_size, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


# ---------------------------------------------------------------------------------------------- the size parser
@pytest.mark.parametrize("text, expected", [
    ("12GB", 12 * 1000**3),
    ("12 gb", 12_000_000_000),
    ("512MiB", 512 * 1024 * 1024),
    ("1.5G", 1_610_612_736),  # 1.5 x 1024^3, as `free -g` reads G
    ("2k", 2048),
    ("3KB", 3000),
    ("1TiB", 1_099_511_627_776),
    ("4096", 4096),
    (4096, 4096),
    ("1e9", 1_000_000_000),
    ("0.5MiB", 524_288),
])
def test_sizes_read_as_hand_computed(text, expected):
    assert parse_size(text) == expected


def test_auto_is_the_free_memory_not_a_size():
    assert parse_size("auto") is None and parse_size(" AUTO ") is None
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    budget = resolve("auto")
    assert 0 < budget <= meminfo["MemAvailable"]


@pytest.mark.parametrize("bad", ["12XB", "-1GB", "0", "GB", "", "1.2.3GB", "nan", "inf", True])
def test_what_is_not_a_size_is_refused(bad):
    with pytest.raises(ConfigError) as err:
        es.Lens(memory=bad)
    assert err.value.code == "config_invalid"


def test_memory_in_python_yaml_and_the_old_name():
    from entoscope.config import build_operation

    assert es.Lens(memory="12GB").memory == "12GB" and es.Lens().memory == "auto"
    op, _ = build_operation({"operation": "lens", "memory": "512MiB", "data": {"task": "ioi", "n": 2}})
    assert parse_size(op.memory) == 2**29
    old = es.Lens(memory_budget_mb=512)  # saved manifests hold the old field
    assert parse_size(old.memory) == 2**29
    with pytest.raises(ConfigError):
        es.Lens(memory="1GB", memory_budget_mb=512)


# ---------------------------------------------------------------------------------------------- sizing and refusing
@pytest.fixture
def demo_model():
    return es.load_model("demo")


LENS_SITES = es.Sites(activation="resid_post", over=["layer", "position"])


def _counting(model):
    """The number of forwards the model's module runs from now on (a pre-hook on the torch module)."""
    from entoscope.models.adapter import adapt

    calls = []
    adapt(model).module.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_too_small_a_budget_is_refused_before_any_forward_naming_the_smallest(demo_model):
    data = {"task": "ioi", "n": 8}
    calls = _counting(demo_model)
    with pytest.raises(MemoryBudgetError) as err:
        es.Lens(sites=LENS_SITES, memory="1KiB").run(demo_model, data, quiet=True)
    assert err.value.code == "memory_budget" and calls == []
    smallest = err.value.smallest
    assert smallest > 1024 and "memory:" in err.value.remedy
    # the budget it names runs it; one byte less does not
    plan = es.Lens(sites=LENS_SITES, memory=smallest).plan(demo_model, data)
    assert plan.peak_memory_bytes <= smallest
    with pytest.raises(MemoryBudgetError):
        es.Lens(sites=LENS_SITES, memory=smallest - 1).plan(demo_model, data)
    assert calls == []


def test_a_smaller_budget_gives_smaller_batches_within_it(demo_model):
    data = {"task": "ioi", "n": 16}
    roomy = es.Lens(sites=LENS_SITES, memory="8GiB").plan(demo_model, data)
    one = es.Lens(sites=LENS_SITES, memory="1KiB")
    with pytest.raises(MemoryBudgetError) as err:
        one.plan(demo_model, data)
    # between one prompt's peak and the roomy batch's: batches in between, each plan within its budget
    budget = (err.value.smallest + roomy.peak_memory_bytes) // 2
    tight = es.Lens(sites=LENS_SITES, memory=budget).plan(demo_model, data)
    assert max(tight.batch_sizes) < max(roomy.batch_sizes)
    assert tight.peak_memory_bytes <= budget and tight.memory_budget_bytes == budget
    assert sum(tight.batch_sizes) == sum(roomy.batch_sizes) == 16


@pytest.mark.parametrize("case", ["steering", "head_scores", "probing", "patching.exact", "dla"])
def test_a_smaller_budget_gives_every_operation_smaller_batches_within_it(demo_model, case):
    """Each operation whose plan issue 46 fixed, on the demo model: a budget between its smallest (named by the
    refusal of 1 KiB) and its roomy plan's peak gives smaller batches (prompts or patched / steered rows) and a
    plan within that budget."""
    from memory_cases import CASES, Ctx
    from entoscope.models.adapter import adapt

    def plan(memory):
        op, data = CASES[case](Ctx(adapt(demo_model), 16, memory, "demo"))
        return op.plan(demo_model, data)

    roomy = plan("8GiB")
    with pytest.raises(MemoryBudgetError) as err:
        plan("1KiB")
    budget = (err.value.smallest + roomy.peak_memory_bytes) // 2
    tight = plan(budget)
    assert tight.peak_memory_bytes <= budget < roomy.peak_memory_bytes
    assert max(tight.batch_sizes) < max(roomy.batch_sizes), (tight.batch_sizes, roomy.batch_sizes)


def test_a_batch_size_over_the_budget_is_refused(demo_model):
    with pytest.raises(MemoryBudgetError) as err:
        es.Lens(sites=LENS_SITES, batch_size=8, memory="1KiB").plan(demo_model, {"task": "ioi", "n": 8})
    assert err.value.code == "memory_budget" and err.value.smallest > 1024


def test_the_command_line_refuses_with_the_code(capsys):
    from entoscope.cli import main

    rc = main(["lens", "--model", "demo", "--data", "{task: ioi, n: 4}", "--memory", "1KiB", "--plan"])
    err = capsys.readouterr().err
    assert rc == 2 and "[memory_budget]" in err and "give memory:" in err
    rc = main(["lens", "--model", "demo", "--data", "{task: ioi, n: 4}", "--memory", "12XB", "--plan"])
    assert rc == 2 and "[config_invalid]" in capsys.readouterr().err


def test_the_report_refuses_a_bad_size_before_loading(tmp_path, capsys):
    from entoscope.cli import main

    rc = main(["report", "--model", "demo", "--out", str(tmp_path / "r"), "--memory", "lots"])
    assert rc == 2 and "[config_invalid]" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_every_operation_refuses_a_tiny_budget_before_any_forward(demo_model):
    """Each operation of the cost table (benchmarks/memory_cases.py) on the demo model, with 1 KiB: refused with
    memory_budget, no forward run (the model's one-time capability probes, e.g. whether it can start part-way,
    are made first by a plan with room)."""
    from memory_cases import CASES, Ctx
    from entoscope.models.adapter import adapt

    for case in CASES.values():
        op, data = case(Ctx(adapt(demo_model), 4, "4GiB", "demo"))
        op.plan(demo_model, data)
    calls = _counting(demo_model)
    for name, case in CASES.items():
        op, data = case(Ctx(adapt(demo_model), 4, "1KiB", "demo"))
        with pytest.raises(EntoscopeError) as err:
            op.plan(demo_model, data)
        assert err.value.code == "memory_budget", (name, err.value)
    assert calls == []


@pytest.mark.parametrize("case", ["circuits.eap_ig", "interchange", "jacobian_fit"])
def test_the_smallest_budget_named_runs_and_a_byte_less_is_refused(demo_model, case):
    """The smallest budget a refusal names is the plan's peak at its smallest sizes: with it the plan is made and
    stays within it, with its batches no larger than a roomy budget's (smaller where the roomy plan needs more);
    one byte less is refused."""
    from memory_cases import CASES, Ctx
    from entoscope.models.adapter import adapt

    def plan(memory):
        op, data = CASES[case](Ctx(adapt(demo_model), 8, memory, "demo"))
        return op.plan(demo_model, data)

    with pytest.raises(MemoryBudgetError) as err:
        plan("1KiB")
    smallest = err.value.smallest
    roomy, tight = plan("8GiB"), plan(smallest)
    assert tight.peak_memory_bytes <= smallest <= roomy.peak_memory_bytes
    assert max(tight.batch_sizes) <= max(roomy.batch_sizes)
    if roomy.peak_memory_bytes > smallest:
        assert max(tight.batch_sizes) < max(roomy.batch_sizes) or tight.backward_passes != roomy.backward_passes \
            or tight.notes != roomy.notes  # fewer prompts per batch, or (the Jacobian fit) fewer copies each
    with pytest.raises(MemoryBudgetError):
        plan(smallest - 1)


# ---------------------------------------------------------------------------------------------- measured (real)
def _measure(folder, case, memory="auto", n=8):
    from memory_cases import measure

    r = measure(str(folder), "float32", case, n=n, memory=memory, timeout=600)
    assert "error" not in r, r.get("error")
    return r


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("case", ["patching.attribution", "lens"])
def test_a_forced_budget_is_held_in_a_fresh_process(smollm2_folder, case):
    """On SmolLM2, with half the memory a run takes unbounded (the plan's accuracy is the next test's): it picks smaller batches and its peak resident
    memory above the loaded model (VmHWM, measured by the kernel in a fresh process) stays under the budget; or
    it is refused before any forward naming a smallest budget, and with that budget it runs and stays under it.
    (Attribution patching's peak is mostly its batch's backward: it shrinks; the lens's is mostly the [sites,
    vocabulary] sums of its table: it is refused.)"""
    free = _measure(smollm2_folder, case, n=12)
    budget = free["measured"] // 2
    tight = _measure(smollm2_folder, case, memory=budget, n=12)
    if "refused" in tight:
        assert tight["refused"] == "memory_budget" and "measured" not in tight
        from entoscope.memory import parse_size

        budget = parse_size(tight["message"].split("give memory: ")[1].split(" ")[0])
        assert budget > free["measured"] // 2
        tight = _measure(smollm2_folder, case, memory=budget, n=12)
    else:
        assert max(tight["batch_sizes"]) < max(free["batch_sizes"])
    assert "refused" not in tight, tight.get("message")
    assert tight["measured"] <= budget, (tight["measured"] / 2**20, budget / 2**20)


PLAN_CASES = ["patching.attribution", "steering", "probing", "patching.exact", "dla", "head_scores", "circuits.eap",
              "circuits.eap_ig", "interchange", "jacobian_fit"]  # the lens: minutes
SMALL_PEAKS = {"head_scores", "dla", "patching.exact", "probing"}  # peaks of 30-95 MiB on the real models, most of
# it FIXED's
PLAN_PROMPTS = {"jacobian_fit": 2,  # its case fits min(n, 4) prompts, 8 copies each: two prompts take a minute
                "circuits.eap": 16}  # two batches: one alone leaves its faithfulness runs 1.24x over (n 8)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("case", PLAN_CASES)
def test_the_plans_peak_is_within_a_quarter_of_the_measured(real_folder, case):
    """plan().peak_memory_bytes against the peak resident memory above the loaded model (VmHWM in a fresh
    process, one thread), on each real model."""
    from conftest import has_hooked_transformer

    if has_hooked_transformer() and "gemma" in str(real_folder):
        pytest.skip("Gemma 3's plans are measured in the transformer-lens 4 pass (the same footprint code; CI's time)")
    n = PLAN_PROMPTS.get(case, 8)
    r = _measure(real_folder, case, n=n)
    ratio = r["plan_peak"] / r["measured"]
    if not 0.75 <= ratio <= 1.25:
        # one fresh process's peak reads up to ~15% low or high on a shared machine (CI read attribution patching
        # at 240 MiB where three quiet runs read 282-288): a second process, and the plan is held to the higher
        # of the two peaks, the one it must cover
        again = _measure(real_folder, case, n=n)
        r["measured"] = max(r["measured"], again["measured"])
        ratio = r["plan_peak"] / r["measured"]
    if case in SMALL_PEAKS and ratio > 1.25:
        # these hold a few tens of MiB of tensors: their peak is mostly the run's own objects (the manifest, the
        # tables), measured at 30-45 MiB and varying by +-15 MiB between fresh processes, against the 40 MiB
        # models/footprint.FIXED counts (head scores: FIXED_LEAN, 16); over is the safe side (under fails), a known
        # gap of issue 46
        pytest.xfail(f"{case}'s plan is {ratio:.2f}x the measured peak ({r['plan_peak'] / 2**20:.0f} vs "
                     f"{r['measured'] / 2**20:.0f} MiB; issue 46)")
    assert 0.75 <= ratio <= 1.25, (case, r["plan_peak"] / 2**20, r["measured"] / 2**20)


# ---------------------------------------------------------------------------------------------- autograd's share
def _saved_bytes(model, T, frozen):
    """What autograd saves in one forward of a T-token prompt, recorded by torch's own saved_tensors_hooks
    (the storages other than the weights')."""
    import torch

    from entoscope.models.adapter import Intervention
    from entoscope.models.names import ActName

    params = list(model.module.parameters())
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    flags = [p.requires_grad for p in params]
    ivs = []
    if frozen:
        for p in params:
            p.requires_grad_(False)
        ivs = [Intervention(ActName("resid_pre", 0), lambda h: h.detach().requires_grad_(True))]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.run(torch.zeros((1, T), dtype=torch.long), interventions=ivs, grad=True,
                      logits_at=torch.tensor([T - 1]))
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return sum(seen.values())


@pytest.mark.parametrize("frozen", [False, True])
def test_the_saved_for_backward_estimate_against_autograds_record(demo_model, frozen):
    """models/footprint.saved_rates (from the structure) against what autograd records for a 16-token forward."""
    from entoscope.models.adapter import adapt
    from entoscope.models.footprint import saved_rates

    a = adapt(demo_model)
    per_token, per_square = saved_rates(a.structure, 4, frozen)
    estimate = 16 * per_token + 256 * per_square
    assert 0.75 <= estimate / _saved_bytes(a, 16, frozen) <= 1.25


@pytest.mark.real
@pytest.mark.parametrize("frozen", [False, True])
def test_the_saved_for_backward_estimate_on_the_real_models(real_folder, frozen):
    from entoscope.models.adapter import adapt
    from entoscope.models.footprint import saved_rates

    a = adapt(es.load_model(str(real_folder)))
    per_token, per_square = saved_rates(a.structure, 4, frozen)
    estimate = 16 * per_token + 256 * per_square
    assert 0.75 <= estimate / _saved_bytes(a, 16, frozen) <= 1.25


# ---------------------------------------------------------------------------------------------- the time estimate
def test_the_plans_time_comes_from_one_calibration_forward(demo_model):
    """calibrate = plan + one forward (and one forward with its backward where the plan counts backwards);
    plan alone runs none."""
    data = {"task": "ioi", "n": 8}
    es.Patching(method="attribution").plan(demo_model, data)  # the one-time capability probes made
    calls = _counting(demo_model)
    plain = es.Patching(method="attribution").plan(demo_model, data)
    assert calls == [] and plain.seconds is None
    plan = es.Patching(method="attribution").calibrate(demo_model, data)
    assert len(calls) == 2 and plan.backward_passes > 0
    assert plan.seconds > 0 and "time              ~" in str(plan) and "calibration" not in plan.notes
    calls.clear()
    dla = es.DirectLogitAttribution().calibrate(demo_model, data)
    assert len(calls) == 1 and dla.backward_passes == 0 and dla.seconds > 0


# ---------------------------------------------------------------------------------------------- hashing weights
def test_a_transposed_weight_is_hashed_in_blocks_to_the_same_digest(monkeypatch):
    """A tied unembedding (W_E transposed) is hashed block by block (models/fingerprint.hash_into): the digest is
    hashlib's over the whole tensor's row-major bytes, and no block copied is more than HASH_CHUNK bytes (Gemma
    3's W_U copied whole was the Jacobian fit's peak: 640 MiB)."""
    import hashlib

    import torch

    import entoscope.models.fingerprint as fpr

    t = torch.randn(3000, 700).T  # [700, 3000], not contiguous: 8.4 MB
    monkeypatch.setattr(fpr, "HASH_CHUNK", 2**20)
    sizes = []
    whole = fpr.tensor_bytes
    monkeypatch.setattr(fpr, "tensor_bytes", lambda x: (sizes.append(x.numel() * x.element_size()), whole(x))[1])
    h = hashlib.sha256()
    fpr.hash_into(h, t)
    assert h.hexdigest() == hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    assert len(sizes) > 1 and max(sizes) <= 2**20
