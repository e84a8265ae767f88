"""The component graph: edge counts and names against an enumeration written here, MIB's GPT-2 small
count, pruning on a hand-built circuit, and the JSON / GraphML / networkx exports."""

import json

import networkx as nx
import pytest
import torch

from entoscope.circuits.graph import Circuit, ComponentGraph, Node
from entoscope.errors import UnknownNameError
from entoscope.models import adapt

from conftest import get_tiny


def enumerate_edges(n_layers, n_heads, n_kv, parallel):
    """Every edge by the rules of the vocabulary, written out node by node."""
    kv = "kv" if n_kv != n_heads else "h"
    edges, upstream = [], ["input"]
    for L in range(n_layers):
        heads = [f"a{L}.h{h}" for h in range(n_heads)]
        receivers = [f"a{L}.h{h}<q>" for h in range(n_heads)]
        receivers += [f"a{L}.{kv}{j}<{x}>" for x in "kv" for j in range(n_kv)]
        edges += [f"{s}->{r}" for r in receivers for s in upstream]
        mlp_reads = upstream if parallel else upstream + heads
        edges += [f"{s}->m{L}" for s in mlp_reads]
        upstream = upstream + heads + [f"m{L}"]
    edges += [f"{s}->logits" for s in upstream]
    return edges


def test_gpt2_small_has_mibs_32491_edges():
    from transformers import GPT2Config

    graph = ComponentGraph.from_config(GPT2Config())
    assert graph.n_edges == 32491
    assert graph.n_senders == 1 + 12 * 13 and graph.n_receivers == 12 * (3 * 12 + 1) + 1


@pytest.mark.parametrize("shape", [(2, 4, 4, False), (3, 4, 4, True), (2, 4, 2, False), (3, 6, 2, True),
                                   (1, 1, 1, False)])
def test_edges_match_the_enumeration(shape):
    graph = ComponentGraph(*shape)
    names = graph.edge_names()
    expected = enumerate_edges(*shape)
    assert len(names) == len(set(names)) == graph.n_edges
    assert set(names) == set(expected)
    for name in names:
        s, r = graph.edge_index(name)
        assert graph.edge_name(s, r) == name


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_graph_of_each_tiny_family(family):
    a = adapt(get_tiny(family, "bridge", False))
    graph = ComponentGraph.from_model(a)
    s = a.structure
    assert set(graph.edge_names()) == set(enumerate_edges(s.n_layers, s.n_heads, s.n_kv_heads, s.parallel))
    if family == "neox":  # parallel blocks: the MLP reads what attention reads
        assert "a0.h0->m0" not in graph.edge_names() and "a0.h0->m1" in graph.edge_names()
    if family == "llama":  # 4 query heads share 2 key/value heads
        assert "input->a0.kv1<k>" in graph.edge_names() and "input->a0.h3<k>" not in graph.edge_names()


def test_unknown_and_impossible_edges_are_refused():
    graph = ComponentGraph(2, 4)
    with pytest.raises(UnknownNameError) as err:
        graph.edge_index("a1.h0->a0.h1<q>")  # not upstream
    assert err.value.code == "unknown_edge"
    with pytest.raises(UnknownNameError):
        graph.edge_index("a0.h9->m1")
    with pytest.raises(UnknownNameError):
        graph.edge_index("a0.h1")
    assert Node.parse("a3.kv1") == Node("a3.kv1", "kv", 3, 1)
    assert Node.parse("m2").kind == "mlp" and Node.parse("logits").kind == "logits"


def test_pruning_drops_edges_that_cannot_reach_the_output_or_be_reached():
    graph = ComponentGraph(2, 2)
    kept = torch.zeros(graph.n_senders, graph.n_receivers, dtype=torch.bool)
    keep = ["input->a0.h0<q>", "a0.h0->logits",  # a path
            "a1.h0->logits",  # a1.h0 reads nothing kept: its output is its corrupt value
            "input->a0.h1<v>",  # a0.h1 writes nowhere kept
            "a0.h0->m0", "m0->a1.h1<k>"]  # a1.h1 writes nowhere kept: both edges are dead
    for name in keep:
        kept[graph.edge_index(name)] = True
    pruned = Circuit(graph, kept=kept).pruned()
    assert {e.name for e in pruned.edges(only_kept=True)} == {"input->a0.h0<q>", "a0.h0->logits"}


def test_json_round_trip_and_mib_layout(tmp_path):
    graph = ComponentGraph(2, 4, 2)
    torch.manual_seed(0)
    scores = torch.randn(graph.n_senders, graph.n_receivers)
    kept = torch.rand(graph.n_senders, graph.n_receivers) > 0.7
    circuit = Circuit(graph, scores, kept)
    path = circuit.save_json(tmp_path / "c.json")
    raw = json.loads(path.read_text())
    assert set(raw) == {"cfg", "nodes", "edges"}
    assert raw["cfg"]["n_layers"] == 2 and raw["cfg"]["n_heads"] == 4 and raw["cfg"]["n_key_value_heads"] == 2
    assert len(raw["edges"]) == graph.n_edges
    name = "input->a1.h3<q>"
    s, r = graph.edge_index(name)
    assert raw["edges"][name] == {"score": pytest.approx(float(scores[s, r])), "in_graph": bool(kept[s, r])}
    back = Circuit.from_json(path)
    assert back.graph == graph
    assert torch.equal(back.kept, circuit.kept)
    torch.testing.assert_close(back.scores, circuit.scores)


def test_networkx_and_graphml(tmp_path):
    graph = ComponentGraph(2, 4, 2)
    kept = graph.mask.clone()
    circuit = Circuit(graph, torch.ones(graph.n_senders, graph.n_receivers), kept)
    G = circuit.to_networkx()
    scored = [(u, v, k) for u, v, k, d in G.edges(keys=True, data=True) if d["kind"] == "edge"]
    assert len(scored) == graph.n_edges
    assert G.has_edge("a0.h1", "a1.kv0", key="a0.h1->a1.kv0<k>")
    assert G.has_edge("a1.kv1", "a1.h3")  # the key/value head feeds the query heads that read it
    path = circuit.save_graphml(tmp_path / "c.graphml")
    H = nx.read_graphml(path)
    assert H.number_of_nodes() == G.number_of_nodes() and H.number_of_edges() == G.number_of_edges()
