"""Edge patching against the clean and corrupt runs and a hook implementation written here;
circuit selection, faithfulness, CPR and CMD against direct computations."""

import numpy as np
import pytest
import torch

from entoscope.circuits.edge_patching import EdgePatcher, corrupt_senders, run_with_edges
from entoscope.circuits.faithfulness import (MIB_FRACTIONS, above, cmd, cpr, faithfulness, faithfulness_curve,
                                             top_n)
from entoscope.circuits.graph import Circuit, ComponentGraph
from entoscope.data import Dataset, Example
from entoscope.data.tokenized import make_batches, tokenize_data
from entoscope.metrics import logit_diff
from entoscope.models import adapt

from conftest import get_tiny, has_hooked_transformer, random_pair_batch


def _pair(seed=0, B=3, T=7):
    return random_pair_batch(seed, B, T, corrupt_to=4)


def test_all_edges_kept_is_the_clean_run_and_none_the_corrupt_run(tiny):
    a = adapt(tiny)
    graph = ComponentGraph.from_model(a)
    b = _pair()
    C, corrupt_logits = corrupt_senders(a, b)
    clean_logits = a.run(b.tokens).logits
    everything = graph.mask.clone()
    nothing = torch.zeros_like(everything)
    torch.testing.assert_close(run_with_edges(a, b.tokens, C, graph, everything), clean_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(run_with_edges(a, b.tokens, C, graph, nothing), corrupt_logits, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- a hand-written edge patch
def _norm(weights, layer, which, x):
    """The block's norm, written out: LayerNorm or RMSNorm with its own parameters."""
    n = weights.norm(layer, which) if which != "final" else weights.final_norm
    if n.kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + n.eps)
    else:
        y = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + n.eps)
    if n.weight is not None:
        y = y * n.weight
    if n.bias is not None:
        y = y + n.bias
    return y


def _sender_value(a, cache, sender):
    if sender == "input":
        return cache[a.hook_name("resid_pre.0")]
    if sender.startswith("m"):
        return cache[a.hook_name(f"mlp_out.{sender[1:]}")]
    layer, head = (int(x) for x in sender[1:].split(".h"))
    return cache[a.hook_name(f"z.{layer}")][:, :, head] @ a.weights.W_O(layer)[head]


def hand_patched_logits(model, tokens, corrupt_tokens, sender, receiver):
    """Run `tokens` with receiver reading sender's corrupt output instead of its clean one, with
    TransformerLens hooks written here (q/k/v recomputed from the receiver's own residual)."""
    a = adapt(model)
    s, w = a.structure, a.weights
    _, clean = model.run_with_cache(tokens)
    _, corrupt = model.run_with_cache(corrupt_tokens)
    delta = _sender_value(a, corrupt, sender) - _sender_value(a, clean, sender)
    stash = {}
    hooks = []
    if receiver == "logits":
        hooks.append((a.hook_name(f"resid_post.{s.n_layers - 1}"), lambda x, hook: x + delta))
    elif receiver.startswith("m"):
        layer = int(receiver[1:])
        site = f"resid_pre.{layer}" if s.parallel else f"resid_mid.{layer}"
        hooks.append((a.hook_name(site), lambda x, hook: stash.__setitem__("x", x)))
        hooks.append((a.hook_name(f"mlp_in.{layer}"), lambda x, hook: _norm(w, layer, "ln2", stash["x"] + delta)))
    else:
        node, which = receiver[:-3], receiver[-2]
        layer = int(node[1:].split(".")[0])
        idx = int(node.split(".")[1].lstrip("hkv"))
        if which == "q":
            W, b = w.W_Q(layer)[idx], w.b_Q(layer)[idx]
        else:
            W = (w.W_K_kv(layer) if which == "k" else w.W_V_kv(layer))[idx]
            b = (w.b_K(layer) if which == "k" else w.b_V(layer))[idx * s.group_size]

        def replace(x, hook):
            x = x.clone()
            x[:, :, idx] = _norm(w, layer, "ln1", stash["x"] + delta) @ W + b
            return x
        hooks.append((a.hook_name(f"resid_pre.{layer}"), lambda x, hook: stash.__setitem__("x", x)))
        hooks.append((a.hook_name(f"{which}.{layer}"), replace))
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


EDGES = {"gpt2": ["a0.h1->a1.h2<k>", "input->m0", "a0.h3->logits", "m0->a1.h0<q>", "a0.h2->a1.h1<v>"],
         "neox": ["a0.h1->a1.h2<k>", "input->m1", "m0->a1.h3<v>", "a1.h0->logits"],
         "llama": ["a0.h1->a1.kv1<k>", "a0.h2->a1.kv0<v>", "m0->a1.h3<q>", "a0.h0->m0", "input->logits"]}
VARIANTS = [("gpt2", "bridge", False), ("neox", "bridge", False), ("llama", "bridge", False),
            ("llama", "bridge", True), ("gpt2", "bridge", True)] + \
    ([("llama", "hooked", False), ("neox", "hooked", False)] if has_hooked_transformer() else [])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}{'-compat' if v[2] else ''}")
def test_single_patched_edge_equals_hand_written_hooks(variant):
    model = get_tiny(*variant)
    a = adapt(model)
    graph = ComponentGraph.from_model(a)
    b = _pair(seed=3)
    C, _ = corrupt_senders(a, b)
    clean = a.run(b.tokens).logits
    for name in EDGES[variant[0]]:
        kept = graph.mask.clone()
        kept[graph.edge_index(name)] = False
        mine = run_with_edges(a, b.tokens, C, graph, kept)
        theirs = hand_patched_logits(model, b.tokens, b.cf_tokens, *name.split("->"))
        effect = (theirs - clean).abs().max()
        assert effect > 2e-5, f"{name}: patching changed nothing, the test would be empty"
        torch.testing.assert_close(mine - clean, theirs - clean, atol=float(0.01 * effect) + 2e-6, rtol=0, msg=name)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}{'-compat' if v[2] else ''}")
def test_a_circuit_run_starting_at_its_first_patched_layer_equals_the_full_forward(variant):
    """EdgePatcher starts each circuit's run at the first block whose receivers read a patched edge, from the
    clean run; the answer-position logits must equal run_with_edges' full forward."""
    from entoscope.metrics import at_positions
    from entoscope.models.split_inputs import CleanRun, PatchedRun

    a = adapt(get_tiny(*variant))
    graph = ComponentGraph.from_model(a)
    b = _pair(seed=5)
    C, _ = corrupt_senders(a, b)
    clean = CleanRun.of(a, a.run(b.tokens, CleanRun.reads(a.structure)).acts)
    late = graph.mask.clone()
    late[:, : a.structure.n_layers // 2 * graph.layout.per_layer_receivers] = False  # receivers of the top half
    torch.manual_seed(1)
    for kept in (graph.mask & ~(late & (torch.rand(late.shape) > 0.5)), graph.mask & (torch.rand(late.shape) > 0.5)):
        patched = (graph.mask & ~kept).float()
        run = PatchedRun(a, C, patched)
        expected = at_positions(run_with_edges(a, b.tokens, C, graph, kept), b.last)
        with torch.no_grad():
            got = run.logits_at(b.last, b.tokens, clean)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert PatchedRun(a, C, (late & graph.mask).float()).first_layer == a.structure.n_layers // 2


def test_patcher_batches_equal_one_prompt_runs():
    model = get_tiny("gpt2", "bridge", False)
    a = adapt(model)
    graph = ComponentGraph.from_model(a)
    g = torch.Generator().manual_seed(4)
    examples = []
    for length in (5, 9, 7):  # token-id prompts of different lengths, each with a same-length counterfactual
        prompt = torch.randint(1, 300, (length,), generator=g).tolist()
        corrupt = list(prompt)
        corrupt[1] = (corrupt[1] + 7) % 300 + 1
        examples.append(Example(prompt=tuple(prompt), counterfactual=tuple(corrupt), answers=(11,),
                                wrong_answers=(12,)))
    data = Dataset("mixed", tuple(examples))
    td = tokenize_data(a, data, pairs=True, answers=True)
    assert len(set(td.lengths)) > 1
    torch.manual_seed(0)
    kept = graph.mask & (torch.rand(graph.mask.shape) > 0.5)
    together = EdgePatcher(a, graph, make_batches(td, 2, 0), logit_diff).per_prompt(kept)
    for i in range(len(data)):
        alone = EdgePatcher(a, graph, make_batches(tokenize_data(a, data[i:i + 1], pairs=True, answers=True), 1, 0),
                            logit_diff).per_prompt(kept)
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- selection and faithfulness
def test_cpr_and_cmd_equal_a_direct_trapezoid_on_a_hand_made_curve():
    xs = list(MIB_FRACTIONS)
    f = [0.05, -0.2, 0.1, 0.4, 0.7, 1.3, 0.9, 1.0, 0.98, 1.0]
    assert cpr(xs, f) == pytest.approx(np.trapezoid(f, xs))
    assert cmd(xs, f) == pytest.approx(np.trapezoid(np.abs(1 - np.array(f)), xs))
    # by hand on three points: (0, 0.5), (0.5, 1), (1, 1.5)
    assert cpr([0, 0.5, 1], [0.5, 1, 1.5]) == pytest.approx(0.5 * 0.75 + 0.5 * 1.25)
    assert cmd([0, 0.5, 1], [0.5, 1, 1.5]) == pytest.approx(0.5 * 0.25 + 0.5 * 0.25)
    assert faithfulness(3.0, 1.0, 5.0) == pytest.approx(0.5)


def test_top_n_and_threshold_pick_by_absolute_score():
    graph = ComponentGraph(2, 2)
    torch.manual_seed(1)
    scores = torch.randn(graph.n_senders, graph.n_receivers)
    edges = [(abs(float(scores[s, r])), float(scores[s, r]), (s, r)) for s, r in graph.mask.nonzero().tolist()]
    best5 = {e[2] for e in sorted(edges, reverse=True)[:5]}
    kept = top_n(graph, scores, 5)
    assert {tuple(x) for x in kept.nonzero().tolist()} == best5
    signed = {e[2] for e in sorted(edges, key=lambda e: e[1], reverse=True)[:5]}
    assert {tuple(x) for x in top_n(graph, scores, 5, absolute=False).nonzero().tolist()} == signed
    t = 1.0
    assert {tuple(x) for x in above(graph, scores, t).nonzero().tolist()} == {e[2] for e in edges if e[0] >= t}
    assert not (top_n(graph, scores, graph.n_edges) & ~graph.mask).any()


def test_faithfulness_curve_ends_at_one_and_pruning_changes_nothing():
    a = adapt(get_tiny("gpt2", "bridge", False))
    graph = ComponentGraph.from_model(a)
    patcher = EdgePatcher(a, graph, [_pair(seed=5, B=4)], logit_diff)
    torch.manual_seed(2)
    scores = torch.randn(graph.n_senders, graph.n_receivers)
    curve, summary = faithfulness_curve(patcher, scores, [0.05, 0.2, 1.0])
    assert curve["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=1e-4)
    f = list(curve["faithfulness"])
    assert summary["cpr"] == pytest.approx(np.trapezoid(f, [0.05, 0.2, 1.0]))
    for n in (5, 20, 40):
        circuit = Circuit(graph, scores, top_n(graph, scores, n))
        torch.testing.assert_close(patcher.per_prompt(circuit.pruned().kept), patcher.per_prompt(circuit.kept),
                                   atol=1e-5, rtol=1e-5)
