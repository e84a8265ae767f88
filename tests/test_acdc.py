"""ACDC: its recorded decisions replayed with edge patching, its thresholds' extremes, its budget,
and the operation's files."""

import math

import pandas as pd
import pytest
import torch

from entoscope.circuits.acdc import acdc
from entoscope.circuits.edge_patching import EdgePatcher
from entoscope.circuits.graph import ComponentGraph
from entoscope.circuits.operation import Circuits
from entoscope.data import Dataset, Example
from entoscope.metrics import kl, logit_diff
from entoscope.models import adapt

from conftest import get_tiny, random_pair_batch


def _pair(seed=0, B=4, T=7):
    return random_pair_batch(seed, B, T, corrupt_to=5)


@pytest.fixture(scope="module")
def setup():
    a = adapt(get_tiny("gpt2", "bridge", False))
    graph = ComponentGraph.from_model(a)
    return a, graph, [_pair()]


def _kl_value(a, graph, batch, C, ref, kept):
    """mean KL(clean || circuit) at the last token, from logits computed here."""
    from entoscope.circuits.edge_patching import run_with_edges
    from entoscope.metrics import at_positions

    logits = at_positions(run_with_edges(a, batch.tokens, C, graph, kept), batch.last)
    p = ref.log_softmax(-1)
    return float((p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean())


def test_decisions_replay(setup):
    """Replaying the recorded decisions from the full graph: each tried edge's recorded value equals a
    fresh evaluation with it removed, and it was removed exactly when the damage was below the threshold."""
    a, graph, batches = setup
    patcher = EdgePatcher(a, graph, batches, kl)
    threshold = 0.02 * float(patcher.empty.mean())  # the tiny random model's KLs are small
    out = acdc(patcher, threshold, kl=True, quiet=True)
    from entoscope.circuits.edge_patching import corrupt_senders
    from entoscope.metrics import at_positions

    (batch,) = batches
    C, _ = corrupt_senders(a, batch)
    ref = at_positions(a.run(batch.tokens).logits, batch.last)
    kept = graph.mask.clone()
    current = 0.0
    tried = out.decisions[out.decisions.decision.isin(["removed", "kept"])]
    assert len(tried) > 10 and (out.decisions.decision == "removed").any() and (out.decisions.decision == "kept").any()
    first = tried.iloc[0].edge
    assert first.endswith("->logits") and first.startswith("m"), "ACDC starts at the logits, latest sender first"
    for row in out.decisions.itertuples():
        s, r = graph.edge_index(row.edge)
        if row.decision.startswith("dropped"):
            kept[s, r] = False
            continue
        trial = kept.clone()
        trial[s, r] = False
        value = _kl_value(a, graph, batch, C, ref, trial)
        assert value == pytest.approx(row.value_without, abs=1e-5)
        assert row.value_before == pytest.approx(current, abs=1e-5)
        assert (row.decision == "removed") == (value - current < threshold)
        if row.decision == "removed":
            kept, current = trial, value
    assert out.value == pytest.approx(current, abs=1e-5)
    assert torch.equal(out.circuit.kept, out.circuit.pruned().kept)


def test_threshold_extremes(setup):
    a, graph, batches = setup
    everything = acdc(EdgePatcher(a, graph, batches, logit_diff), -math.inf, kl=False, quiet=True)
    assert everything.circuit.n_kept == graph.n_edges
    nothing = acdc(EdgePatcher(a, graph, batches, logit_diff), math.inf, kl=False, quiet=True)
    assert nothing.circuit.n_kept == 0
    # once the logits lose every edge nothing else matters: the rest is dropped without a forward pass
    into_logits = int(graph.mask[:, -1].sum())
    assert nothing.forward_passes == into_logits


def test_budget_stops_the_search_and_keeps_the_rest(setup):
    a, graph, batches = setup
    out = acdc(EdgePatcher(a, graph, batches, kl), 1e9, kl=True, max_forward_passes=5, quiet=True)
    assert out.forward_passes == 5 and out.budget_exhausted
    tried = out.decisions[out.decisions.decision.isin(["removed", "kept"])]
    assert len(tried) == 5
    assert (out.decisions.decision == "kept: budget exhausted").sum() > 0


def test_operation_saves_the_decisions(tmp_path):
    model = get_tiny("neox", "bridge", False)
    g = torch.Generator().manual_seed(3)
    examples = []
    for _ in range(3):
        p = torch.randint(1, 300, (7,), generator=g).tolist()
        c = list(p)
        c[1] = (c[1] + 3) % 300 + 1
        examples.append(Example(prompt=tuple(p), counterfactual=tuple(c)))
    data = Dataset("pairs", tuple(examples))  # kl needs no answers
    op = Circuits(method="acdc", metric="kl", acdc_threshold=0.001, max_forward_passes=40)
    result = op.run(model, data, quiet=True)
    assert result.summary["acdc_forward_passes"] <= 40
    folder = result.save(tmp_path / "acdc")
    decisions = pd.read_csv(folder / "acdc_decisions.csv")
    assert set(decisions.columns) >= {"edge", "decision", "damage", "value_without"}
    assert (folder / "circuit.json").exists()
