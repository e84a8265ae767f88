"""EAP and EAP-IG against a brute force written here (autograd on each receiver's own input through
explicit hooks), the integrated-gradients completeness identity, exact single-edge patching, and
the demo model's induction circuit; the `circuits` operation's refusals, files and command."""

import json

import pytest
import torch

import entoscope as es
from entoscope.circuits.eap import edge_scores, ig_points
from entoscope.circuits.edge_patching import EdgePatcher
from entoscope.circuits.graph import Circuit, ComponentGraph
from entoscope.circuits.operation import Circuits, exact_scores
from entoscope.data import Dataset, Example
from entoscope.errors import ConfigError, DataError, UnknownNameError
from entoscope.metrics import at_positions, logit_diff
from entoscope.models import adapt

from conftest import get_tiny, has_hooked_transformer, random_pair_batch


def _pair(seed=0, B=4, T=8):
    return random_pair_batch(seed, B, T, corrupt_to=4)


def _metric_sum(logits, b):
    return logit_diff(at_positions(logits, b.last), b.answers, b.wrong_answers).sum()


# ---------------------------------------------------------------------- the brute force
def _norm(n, x):
    if n.kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    y = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + n.eps)
    if n.weight is not None:
        y = y * n.weight
    return y + n.bias if n.bias is not None else y


def _receiver_hooks(a, receiver, e):
    """Hooks that make `receiver` (and only it) read resid + e."""
    s, w = a.structure, a.weights
    stash = {}
    if receiver == "logits":
        return [(a.hook_name(f"resid_post.{s.n_layers - 1}"), lambda x, hook: x + e)]
    if receiver.startswith("m"):
        L = int(receiver[1:])
        site = f"resid_pre.{L}" if s.parallel else f"resid_mid.{L}"
        return [(a.hook_name(site), lambda x, hook: stash.__setitem__("x", x)),
                (a.hook_name(f"mlp_in.{L}"), lambda x, hook: _norm(w.norm(L, "ln2"), stash["x"] + e))]
    node, which = receiver[:-3], receiver[-2]
    L, idx = int(node[1:].split(".")[0]), int(node.split(".")[1].lstrip("hkv"))
    W = {"q": w.W_Q(L), "k": w.W_K_kv(L), "v": w.W_V_kv(L)}[which][idx]
    b = w.b_Q(L)[idx] if which == "q" else (w.b_K(L) if which == "k" else w.b_V(L))[idx * s.group_size]

    def replace(x, hook):
        x = x.clone()
        x[:, :, idx] = _norm(w.norm(L, "ln1"), stash["x"] + e) @ W + b
        return x
    return [(a.hook_name(f"resid_pre.{L}"), lambda x, hook: stash.__setitem__("x", x)),
            (a.hook_name(f"{which}.{L}"), replace)]


def _senders(a, cache):
    s = a.structure
    parts = [cache[a.hook_name("resid_pre.0")][:, :, None]]
    for L in range(s.n_layers):
        parts.append(torch.einsum("bphd,hdm->bphm", cache[a.hook_name(f"z.{L}")], a.weights.W_O(L)))
        parts.append(cache[a.hook_name(f"mlp_out.{L}")][:, :, None])
    return torch.cat(parts, 2)


def brute_force_eap(model, b):
    """score(s -> r) = sum_pos (s_corrupt - s_clean) . d metric / d e_r, e_r added to r's input alone."""
    a = adapt(model)
    graph = ComponentGraph.from_model(a)
    with torch.no_grad():
        _, clean = model.run_with_cache(b.tokens)
        _, corrupt = model.run_with_cache(b.cf_tokens)
        delta = _senders(a, corrupt) - _senders(a, clean)  # [B, T, S, d]
    scores = torch.zeros(graph.n_senders, graph.n_receivers)
    for r, name in enumerate(graph.receivers):
        e = torch.zeros(b.tokens.shape + (a.structure.d_model,), requires_grad=True)
        logits = model.run_with_hooks(b.tokens, fwd_hooks=_receiver_hooks(a, name, e))
        (grad,) = torch.autograd.grad(_metric_sum(logits, b), e)
        scores[:, r] = torch.einsum("bpsd,bpd->s", delta, grad) / len(b)
    return scores * graph.mask


BRUTE = [("gpt2", "bridge", False), ("neox", "bridge", False), ("llama", "bridge", False),
         ("gpt2", "bridge", True)] + ([("llama", "hooked", False)] if has_hooked_transformer() else [])


@pytest.mark.parametrize("variant", BRUTE, ids=lambda v: f"{v[0]}-{v[1]}{'-compat' if v[2] else ''}")
def test_eap_equals_brute_force_autograd_per_receiver(variant):
    model = get_tiny(*variant)
    a = adapt(model)
    b = _pair(seed=1)
    graph = ComponentGraph.from_model(a)
    mine = edge_scores(a, [b], logit_diff, method="eap", quiet=True) * graph.mask
    theirs = brute_force_eap(model, b)
    assert theirs.abs().max() > 1e-3
    torch.testing.assert_close(mine, theirs, atol=float(2e-4 * theirs.abs().max()), rtol=1e-3)


def test_integration_points():
    assert [p for p, _ in ig_points(4, "left")] == [0, 0.25, 0.5, 0.75]
    assert [p for p, _ in ig_points(4, "right")] == [0.25, 0.5, 0.75, 1.0]
    assert [p for p, _ in ig_points(2, "midpoint")] == [0.25, 0.75]
    assert [w for _, w in ig_points(2, "trapezoid")] == [0.25, 0.5, 0.25]
    for rule in ("left", "right", "midpoint", "trapezoid"):
        assert sum(w for _, w in ig_points(5, rule)) == pytest.approx(1.0)


def test_eap_ig_with_one_point_at_the_clean_end_is_eap():
    """EAP-IG interpolates the input and runs from there; at alpha = 1 that is the clean run."""
    model = get_tiny("neox", "bridge", False)
    b = _pair(seed=6)
    data = Dataset("pairs", tuple(Example(prompt=tuple(p.tolist()), counterfactual=tuple(c.tolist()),
                                          answers=(int(x),), wrong_answers=(int(y),))
                                  for p, c, x, y in zip(b.tokens, b.cf_tokens, b.answers[:, 0], b.wrong_answers[:, 0])))
    eap = Circuits(method="eap", faithfulness=[]).run(model, data, quiet=True).circuit.scores
    ig = Circuits(method="eap_ig", steps=1, rule="right", faithfulness=[]).run(model, data, quiet=True).circuit.scores
    left = Circuits(method="eap_ig", steps=1, rule="left", faithfulness=[]).run(model, data, quiet=True).circuit.scores
    assert eap.abs().max() > 1e-3
    torch.testing.assert_close(ig, eap, atol=float(1e-5 * eap.abs().max()), rtol=1e-4)
    assert (left - eap).abs().max() > 0.05 * eap.abs().max()  # the corrupt end is somewhere else


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_input_edges_add_up_to_the_whole_effect_as_steps_grow(family):
    """Completeness of integrated gradients on the input path: the edges out of `input` sum to
    metric(corrupt) - metric(clean) in the limit."""
    a = adapt(get_tiny(family, "bridge", False))
    b = _pair(seed=0, B=3, T=7)
    target = float(_metric_sum(a.run(b.cf_tokens).logits, b) - _metric_sum(a.run(b.tokens).logits, b)) / len(b)
    graph = ComponentGraph.from_model(a)
    errors = {}
    for steps in (2, 32):
        scores = edge_scores(a, [b], logit_diff, method="eap_ig", steps=steps, rule="midpoint", quiet=True) * graph.mask
        errors[steps] = abs(float(scores[0].sum()) - target)
    assert abs(target) > 1e-3
    assert errors[32] < errors[2]
    assert errors[32] < 0.01 * abs(target) + 1e-5


@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_eap_ig_moves_toward_exact_single_edge_patching(family):
    a = adapt(get_tiny(family, "bridge", False))
    graph = ComponentGraph.from_model(a)
    b = _pair(seed=1, B=6)
    exact = exact_scores(EdgePatcher(a, graph, [b], logit_diff), quiet=True)[graph.mask]

    def error(method, steps, rule):
        s = edge_scores(a, [b], logit_diff, method=method, steps=steps, rule=rule, quiet=True)[graph.mask]
        return float((s - exact).norm() / exact.norm()), float(torch.corrcoef(torch.stack([s, exact]))[0, 1])

    one, eap, many = error("eap_ig", 1, "left"), error("eap", 1, "right"), error("eap_ig", 16, "left")
    assert many[0] < 0.5 * one[0] and many[0] < eap[0]
    assert many[1] > max(one[1], eap[1])


# ---------------------------------------------------------------------- the operation
def _tiny_pairs(n=4):
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(n):
        p = torch.randint(1, 300, (8,), generator=g).tolist()
        c = list(p)
        c[2] = (c[2] + 5) % 300 + 1
        out.append(Example(prompt=tuple(p), counterfactual=tuple(c), answers=(int(p[1]),), wrong_answers=(int(p[3]),)))
    return Dataset("pairs", tuple(out))


def test_plan_refuses_bad_configs_before_any_work():
    model = get_tiny("gpt2", "bridge", False)
    with pytest.raises(DataError) as err:
        Circuits().plan(model, Dataset("p", (Example(prompt=(1, 2, 3), answers=(4,), wrong_answers=(5,)),)))
    assert err.value.code == "data_no_counterfactuals"
    with pytest.raises(ConfigError) as err:
        Circuits(selection="threshold").plan(model, _tiny_pairs())
    assert err.value.code == "threshold_missing"
    with pytest.raises(ConfigError) as err:
        Circuits(n_edges=10**6).plan(model, _tiny_pairs())
    assert err.value.code == "too_many_edges"
    with pytest.raises(UnknownNameError):
        Circuits(metric="no_such_metric").plan(model, _tiny_pairs())
    with pytest.raises(ValueError):
        Circuits(faithfulness=[0.5, 0.1])
    plan = Circuits(method="eap_ig", steps=3).plan(model, _tiny_pairs())
    # prompt backwards: 4 prompts x 3 integration points
    assert plan.backward_passes == 4 * 3 and plan.rows == ComponentGraph.from_model(model).n_edges


def test_run_saves_a_loadable_circuit(tmp_path):
    model = get_tiny("llama", "bridge", False)
    op = Circuits(method="eap_ig", steps=2, n_edges=12, faithfulness=[0.1, 0.5, 1.0])
    result = op.run(model, _tiny_pairs(), quiet=True)
    s = result.summary
    assert s["n_kept"] == 12 and 0 <= s["n_kept_pruned"] <= 12
    assert s["faithfulness"] == pytest.approx((s["m_circuit"] - s["m_empty"]) / (s["m_full"] - s["m_empty"]))
    assert list(result.table["rank"][:3]) == [1, 2, 3]
    assert result.table["score"].abs().is_monotonic_decreasing
    folder = result.save(tmp_path / "run")
    for name in ("circuit.json", "circuit.graphml", "circuit.html", "summary.json", "faithfulness.csv", "index.html"):
        assert (folder / name).exists(), name
    back = Circuit.from_json(folder / "circuit.json")
    assert torch.equal(back.kept, result.circuit.kept)
    assert json.loads((folder / "summary.json").read_text())["n_kept"] == 12
    import networkx as nx  # the graphml holds the circuit: its 12 edges, each named as in the MIB JSON
    g = nx.read_graphml(folder / "circuit.graphml", force_multigraph=True)
    kept_names = {name for name, e in json.loads((folder / "circuit.json").read_text())["edges"].items()
                  if e["in_graph"]}
    assert {k for _, _, k, d in g.edges(keys=True, data=True) if d["kind"] == "edge"} == kept_names
    assert len(kept_names) == 12


def test_command_line(tmp_path, capsys):
    from entoscope.cli import main

    out = tmp_path / "cli"
    code = main(["circuit", "--model", "demo", "--data", "{task: induction, n: 4}", "--method", "eap",
                 "--faithfulness", "[]", "--n-edges", "10", "--out", str(out), "--quiet"])
    assert code == 0
    assert (out / "circuit.json").exists()
    assert "a0" in capsys.readouterr().out


# ---------------------------------------------------------------------- the demo model's induction circuit
@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_demo_induction_circuit_has_a_k_composition_route_near_the_top(demo):
    # The demo model's previous-token head (a0.h3) reaches the induction heads' keys through MLP 0
    # (docs/circuits.md): a route counts when its weakest edge is in EAP-IG's top 5%.
    from entoscope.circuits.routes import k_composition_routes, route_rank

    routes, heads = k_composition_routes(demo, n=16)
    induction = heads[heads.kind == "induction"]
    previous = heads[heads.kind == "previous_token"]
    assert induction.score.max() > 0.8, "head scores find no induction head in the demo model"
    assert previous.score.max() > 0.5, "head scores find no previous-token head in the demo model"
    assert routes, "no previous-token head sits below an induction head"
    data = {"task": "induction", "n": 24, "seed": 11}
    result = Circuits(method="eap_ig", steps=5, n_edges=20).run(demo, data, quiet=True)
    ranks = result.table.set_index("edge")["rank"]
    ranked = [r for route in routes if (r := route_rank(route, ranks)) is not None]
    assert ranked, f"no route is in the graph: {routes}"
    assert min(ranked) <= 0.05 * len(ranks), f"best route's weakest edge rank {min(ranked)} of {len(ranks)}"
    assert result.summary["faithfulness"] > 0.3

def test_route_rank_is_the_weakest_edge_and_none_outside_the_graph():
    import pandas as pd

    from entoscope.circuits.routes import route_rank

    ranks = pd.Series({"a0.h1->m0": 2, "m0->a1.h0<k>": 9, "a0.h1->a1.h0<k>": 30})
    assert route_rank(("a0.h1->m0", "m0->a1.h0<k>"), ranks) == 9
    assert route_rank(("a0.h1->a1.h0<k>",), ranks) == 30
    assert route_rank(("a0.h1->m1", "m1->a1.h0<k>"), ranks) is None
