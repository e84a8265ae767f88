"""Runs that start part-way (models.partial, models.bridge_start) against the model's own full forward:
a run from block L at positions p.. with the unpatched prefix must give the logits of TransformerLens's
run_with_hooks with the same change, on every family and backend; a bridge whose check fails falls back."""

import pytest
import torch

import entoscope as es
from entoscope.errors import ConfigError
from entoscope.models import ActName, Intervention, adapt
from entoscope.models import bridge_start
from entoscope.models.partial import logits_at, prefix_note, prefix_reads, prefix_support, record_past, slice_start
from entoscope.models.tiny import tiny_model
from entoscope.patching import Patching

from conftest import get_tiny


def pairs(n=3, T=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = [([0] + torch.randint(1, 300, (T - 1,), generator=g).tolist(),
             [0] + torch.randint(1, 300, (T - 1,), generator=g).tolist()) for _ in range(n)]
    return es.data.Dataset("random", tuple(es.data.Example(tuple(c), tuple(k), answers=(5,), wrong_answers=(7,))
                                           for c, k in rows))


def _prefix_state(a, tokens, layer):
    out = a.run(tokens, prefix_reads(a, [layer], positions=True))
    acts = dict(out.acts)
    record_past(a, acts, layer)
    return out.logits, acts


def test_runs_started_part_way_equal_the_full_forward(tiny):
    a = adapt(tiny)
    assert prefix_support(a) == "positions" and prefix_note(a) == ""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 300, (3, 9), generator=g)
    source = torch.randn(3, a.structure.d_model, generator=g)
    last = torch.tensor([8, 8, 8])
    n = a.structure.n_layers
    for layer, position in [(0, 0), (1, 0), (0, 4), (n - 1, 6)]:
        full, acts = _prefix_state(a, tokens, layer)

        def write(x, hook=None):  # resid_pre.layer at `position` := source (in the full run's positions)
            x = x.clone()
            x[:, position] = source
            return x
        expected = tiny.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", write)])[:, -1]
        start = slice_start(acts, torch.arange(3), layer, position, n)
        ours = logits_at(a, last - position, start=start,
                         interventions=[Intervention.replace(ActName("resid_pre", layer), source, (slice(None), 0))])
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
        unpatched = logits_at(a, last - position, start=slice_start(acts, torch.arange(3), layer, position, n))
        torch.testing.assert_close(unpatched, full[:, -1], atol=1e-5, rtol=0)
        assert (expected - full[:, -1]).abs().max() > 1e-2  # the write really changes the logits


# ---------------------------------------------------------------------- a bridge whose check fails
def test_a_bridge_whose_attention_ignores_the_prefix_starts_at_layers_only(monkeypatch):
    model = tiny_model("llama", "bridge")  # a fresh model: the check's memo is per model
    monkeypatch.setattr(bridge_start.FrozenPrefix, "update", lambda self, k, v, *a, **kw: (k, v))
    a = adapt(model)
    assert prefix_support(a) == "layers"
    assert "key/value prefix" in prefix_note(a)
    monkeypatch.undo()  # the memo keeps what the check found
    data = pairs()
    sites = es.Sites(activation="resid_pre", over=["layer", "position"], positions=[2, -1])
    plan = Patching(sites=sites).plan(model, data)
    assert any("first changed layer (" in n and "shortcut is refused" in n for n in plan.notes)
    with pytest.raises(ConfigError) as err:
        Patching(sites=sites, prefix_reuse="positions").plan(model, data)
    assert err.value.code == "prefix_reuse_unsupported" and "key/value prefix" in str(err.value)
    auto = Patching(sites=sites, comparison="absolute").run(model, data, quiet=True).extra["patched"]
    off = Patching(sites=sites, comparison="absolute", prefix_reuse="off").run(model, data, quiet=True).extra["patched"]
    torch.testing.assert_close(auto, off, atol=1e-5, rtol=0)


def test_a_bridge_without_a_recipe_runs_full_forwards(monkeypatch):
    model = tiny_model("gpt2", "bridge")
    monkeypatch.delitem(bridge_start.ROTARY_MODULE, "GPT2LMHeadModel")
    a = adapt(model)
    assert prefix_support(a) == "none" and "no recipe" in prefix_note(a)
    plan = Patching().plan(model, pairs(2))
    assert any("every patched run is a full forward (entoscope has no recipe" in n for n in plan.notes)


def test_the_check_runs_once_per_model_and_mode(monkeypatch):
    model = tiny_model("neox", "bridge")
    calls = []
    check = bridge_start._check
    monkeypatch.setattr(bridge_start, "_check", lambda *args: calls.append(1) or check(*args))
    for _ in range(3):
        assert prefix_support(adapt(model)) == "positions"
    assert len(calls) == 1
    shared = get_tiny("neox", "bridge", True)  # another model (compatibility mode): its own check
    shared.__dict__.pop("_entoscope_start_support", None)
    assert prefix_support(adapt(shared)) == "positions"
    assert len(calls) == 2
