"""Information flow routes: proximity shares against a brute force over TransformerLens's cache,
shares summing to one per node, and the threshold against a breadth-first search written here."""

import json

import networkx as nx
import pytest
import torch

import entoscope as es
from entoscope.circuits.ifr import InformationFlowRoutes, flow_importances, flow_reads, node_id
from entoscope.data import Dataset, Example
from entoscope.models import adapt, load_model

from wilson_by_hand import wilson_by_hand
from conftest import available_variants, get_tiny, variant_id


def random_prompts(n=4, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 10, (1,), generator=g))
        out.append(Example(prompt=tuple([0] + torch.randint(1, vocab, (length,), generator=g).tolist())))
    return Dataset("random", tuple(out))


def importances(model, tokens, granularity="head"):
    a = adapt(model)
    with torch.no_grad():
        out = a.run(tokens, flow_reads(a.structure))
        return flow_importances(a, out.acts, granularity)


@pytest.mark.parametrize("granularity", ["head", "token"])
@pytest.mark.parametrize("variant", available_variants(), ids=variant_id)
def test_shares_of_each_node_sum_to_one(variant, granularity):
    m = get_tiny(*variant)
    tokens = torch.tensor([[0, 11, 45, 201, 7, 99, 150, 3], [0, 3, 4, 5, 6, 9, 12, 40]])
    imp = importances(m, tokens, granularity)
    attn_total = imp.attn.flatten(3).sum(-1) + imp.attn_residual + imp.attn_bias
    totals = [attn_total + imp.mlp] if imp.parallel else [attn_total, imp.mlp + imp.mlp_residual]
    for total in totals:
        # one, except at a node none of whose parts is closer to it than its own norm (all shares 0);
        # it happens in the random llama at the BOS position, where x and attention(x) cancel
        defined = total > 0
        assert defined.float().mean() > 0.75
        torch.testing.assert_close(total[defined], torch.ones_like(total[defined]), atol=1e-5, rtol=0)
        assert (total[~defined] == 0).all()
    assert (imp.attn >= 0).all() and (imp.mlp >= 0).all()
    later = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)  # [query, source]: no share from later tokens
    by_query_source = imp.attn if granularity == "token" else imp.attn.permute(0, 1, 3, 2, 4)
    assert (by_query_source[..., later] == 0).all()


def _proximity(part, total):
    return max(float(total.abs().sum() - (total - part).abs().sum()), 0.0)


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_shares_equal_a_brute_force_over_the_cache(family):
    """Parts rebuilt from TransformerLens's cache one head and one token at a time (v per key/value
    head, so llama's grouped-query attention is exercised; NeoX's parallel block puts the MLP in the
    same sum)."""
    m = get_tiny(family, "bridge", False)
    a = adapt(m)
    s = a.structure
    tokens = torch.tensor([[0, 17, 52, 88, 120, 9, 33]])
    imp = importances(m, tokens)
    with torch.no_grad():
        _, cache = m.run_with_cache(tokens)
    group = s.n_heads // s.n_kv_heads
    for layer in range(s.n_layers):
        W_O, b_O = a.weights.W_O(layer).detach(), a.weights.b_O(layer).detach()
        for q in (2, 6):
            pre = cache[f"blocks.{layer}.hook_resid_pre"][0, q]
            node = cache[f"blocks.{layer}.hook_resid_{'post' if s.parallel else 'mid'}"][0, q]
            parts = {"residual": pre, "bias": b_O}
            for h in range(s.n_heads):
                for k in range(q + 1):
                    v = cache[f"blocks.{layer}.attn.hook_v"][0, k, h // group]
                    parts[(h, k)] = cache[f"blocks.{layer}.attn.hook_pattern"][0, h, q, k] * (v @ W_O[h])
            if s.parallel:
                parts["mlp"] = cache[f"blocks.{layer}.hook_mlp_out"][0, q]
            torch.testing.assert_close(sum(parts.values()), node, atol=1e-5, rtol=1e-5)
            prox = {key: _proximity(p, node) for key, p in parts.items()}
            total = sum(prox.values())
            assert float(imp.attn_residual[layer, 0, q]) == pytest.approx(prox["residual"] / total, abs=1e-5)
            assert float(imp.attn_bias[layer, 0, q]) == pytest.approx(prox["bias"] / total, abs=1e-5)
            for h in range(s.n_heads):
                for k in range(q + 1):
                    assert float(imp.attn[layer, 0, q, h, k]) == pytest.approx(prox[(h, k)] / total, abs=1e-5)
            if s.parallel:
                assert float(imp.mlp[layer, 0, q]) == pytest.approx(prox["mlp"] / total, abs=1e-5)
            else:
                post = cache[f"blocks.{layer}.hook_resid_post"][0, q]
                pm = _proximity(cache[f"blocks.{layer}.hook_mlp_out"][0, q], post)
                pr = _proximity(node, post)
                assert float(imp.mlp[layer, 0, q]) == pytest.approx(pm / (pm + pr), abs=1e-5)


def _expected_edges(imp, b, last, tau):
    """Breadth-first, top-down: edges above tau into nodes already reached, from resid_post.(L-1)@last."""
    L = imp.attn_residual.shape[0]
    par = imp.parallel
    attn_node = "resid_post" if par else "resid_mid"

    def pre(layer, p):
        return node_id("resid_pre", 0, p) if layer == 0 else node_id("resid_post", layer - 1, p)

    reached = {node_id("resid_post", L - 1, last)}
    edges = {}  # (source, target, component) -> importance
    for layer in range(L - 1, -1, -1):
        T = imp.attn_residual.shape[2]
        for q in range(T):
            post = node_id("resid_post", layer, q)
            if not par and post in reached:
                mid = node_id("resid_mid", layer, q)
                for key, value in (("residual", imp.mlp_residual[layer, b, q]), (f"m{layer}", imp.mlp[layer, b, q])):
                    if value > tau:
                        edges[(mid, post, key)] = float(value)
                        reached.add(mid)
        for q in range(T):
            node = node_id(attn_node, layer, q)
            if node not in reached:
                continue
            if imp.attn_residual[layer, b, q] > tau:
                edges[(pre(layer, q), node, "residual")] = float(imp.attn_residual[layer, b, q])
                reached.add(pre(layer, q))
            if par and imp.mlp[layer, b, q] > tau:
                edges[(pre(layer, q), node, f"m{layer}")] = float(imp.mlp[layer, b, q])
                reached.add(pre(layer, q))
            for h in range(imp.attn.shape[3]):
                for k in range(T):
                    if imp.attn[layer, b, q, h, k] > tau:
                        edges[(pre(layer, k), node, f"a{layer}.h{h}")] = float(imp.attn[layer, b, q, h, k])
                        reached.add(pre(layer, k))
    return edges, reached


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_threshold_keeps_exactly_the_edges_above_tau_reachable_from_the_prediction(family):
    m = get_tiny(family, "bridge", True)
    a = adapt(m)
    data = random_prompts(4, seed=5)
    tau = 0.03
    result = InformationFlowRoutes(tau=tau, batch_size=4).run(m, data, quiet=True)
    for i, ex in enumerate(data):
        tokens = torch.tensor([list(ex.prompt)])
        imp = importances(m, tokens)
        expected, reached = _expected_edges(imp, 0, len(ex.prompt) - 1, tau)
        g = result.extra["graphs"][i]
        assert set(g.edges(keys=True)) == set(expected)
        for u, v, key, d in g.edges(keys=True, data=True):  # computed top-down, only where needed: the same value
            assert d["importance"] == pytest.approx(expected[(u, v, key)], abs=1e-5)
        assert set(g.nodes) == reached
        assert all(d["importance"] > tau for _, _, d in g.edges(data=True))
        top = node_id("resid_post", a.structure.n_layers - 1, len(ex.prompt) - 1)
        assert all(nx.has_path(g, n, top) for n in g.nodes)
        assert g.graph["predicted_id"] == int(m(tokens)[0, -1].argmax())


def test_parallel_blocks_read_one_node_and_sequential_mlps_read_resid_mid():
    data = random_prompts(3, seed=6)
    for family, source_states in (("neox", {"resid_pre", "resid_post"}), ("gpt2", {"resid_mid"})):
        r = InformationFlowRoutes(tau=0.01).run(get_tiny(family, "bridge", False), data, quiet=True)
        mlp = r.per_prompt[r.per_prompt.kind == "mlp"]
        assert len(mlp)
        assert {s.split(".")[0] for s in mlp.source} <= source_states
        assert (mlp.source_position == mlp.target_position).all()
        states = {d["state"] for g in r.extra["graphs"] for _, d in g.nodes(data=True)}
        assert ("resid_mid" in states) == (family == "gpt2")


def test_higher_tau_gives_a_subgraph_and_batching_changes_nothing():
    m = get_tiny("llama", "bridge", False)
    data = random_prompts(5, seed=7)
    low = InformationFlowRoutes(tau=0.02, batch_size=5).run(m, data, quiet=True)
    single = InformationFlowRoutes(tau=0.02, batch_size=1).run(m, data, quiet=True)
    high = InformationFlowRoutes(tau=0.1, batch_size=5).run(m, data, quiet=True)
    for g_low, g_one, g_high in zip(low.extra["graphs"], single.extra["graphs"], high.extra["graphs"]):
        assert set(g_low.edges(keys=True)) == set(g_one.edges(keys=True))
        assert set(g_high.edges(keys=True)) <= set(g_low.edges(keys=True))
    tok = InformationFlowRoutes(tau=0.02, granularity="token").run(m, data, quiet=True)
    assert set(tok.per_prompt.component) <= {"residual"} | {f"a{L}" for L in range(2)} | {f"m{L}" for L in range(2)}


def test_demo_ioi_graphs_save_as_graphml_and_json(tmp_path):
    m = load_model("demo")
    result = InformationFlowRoutes(tau=0.04, drawn_routes=2).run(m, es.tasks.ioi(n=4, seed=2), quiet=True)
    table = result.table
    assert len(table) == 3 * (4 + 1)
    assert ((table.in_route >= 0) & (table.in_route <= 1)).all()
    folder = result.save(tmp_path / "ifr")
    assert len(result.figures()) == 3
    for i, g in enumerate(result.extra["graphs"]):
        back = nx.read_graphml(folder / "graphs" / f"example_{i}.graphml", force_multigraph=True)
        assert back.number_of_edges() == g.number_of_edges() and set(back.nodes) == set(g.nodes)
        data = json.loads((folder / "graphs" / f"example_{i}.json").read_text())
        again = nx.node_link_graph(data, edges="edges")
        assert sorted(again.edges(keys=True)) == sorted(g.edges(keys=True))
        assert len(result.per_prompt[result.per_prompt.example == i]) == g.number_of_edges()


def test_report_section_saves_every_route(tmp_path):
    from entoscope.report.sections.ifr import ifr_section

    section = ifr_section(load_model("demo"), tmp_path / "ifr", True)
    assert "IOI" in section.title and "<table" in section.body
    graphs = sorted((tmp_path / "ifr" / "graphs").glob("*.graphml"))
    assert len(graphs) == 4  # quick: 4 prompts
    for path in graphs:
        g = nx.read_graphml(path, force_multigraph=True)
        assert g.number_of_edges() > 0
        assert all(float(d["importance"]) > float(g.graph["tau"]) for _, _, d in g.edges(data=True))


def test_in_route_interval_is_the_wilson_score_interval_of_the_prompts_counted_from_the_graphs():
    """in_route's share, counted here from each prompt's saved graph, and its interval by the Wilson formula
    written out here (z from the normal quantile), for every component."""
    from statistics import NormalDist

    m = load_model("demo")
    result = InformationFlowRoutes(tau=0.04).run(m, es.tasks.ioi(n=6, seed=3), quiet=True)
    graphs = list(result.extra["graphs"])
    n = len(graphs)
    z = NormalDist().inv_cdf(0.975)
    seen_full = False
    for _, row in result.table.iterrows():
        used = sum(any(d["component"] == row.component for _, _, d in g.edges(data=True)) for g in graphs)
        assert row.in_route == pytest.approx(used / n)
        low, high = wilson_by_hand(used, n)
        assert row.in_route_ci_low == pytest.approx(low, abs=1e-12)
        assert row.in_route_ci_high == pytest.approx(high, abs=1e-12)
        seen_full |= used == n
    assert seen_full  # a component every route uses: the case a bootstrap collapses to [1, 1]
    full = result.table[result.table.in_route == 1].iloc[0]
    assert full.in_route_ci_low == pytest.approx(n / (n + z * z)) and full.in_route_ci_low < 0.75


def test_link_graph_writes_what_networkx_writes_for_the_same_calls():
    """LinkGraph against networkx itself: the same add_node / add_edge calls (nodes added implicitly by an
    edge, an attribute set after adding, parallel keyed edges, a repeated key updating its edge, edges
    added out of source order) give the same node-link data, order included."""
    from entoscope.circuits.route_links import LinkGraph

    calls = [("node", "a", {"x": 1}), ("node", "b", {"x": 2}), ("edge", "b", "a", "k1", {"w": 0.5}),
             ("edge", "a", "c", "k1", {"w": 1.0}), ("edge", "a", "b", "k2", {"w": 2.0}),
             ("edge", "a", "c", "k0", {"w": 3.0}), ("node", "a", {"y": 4}), ("edge", "a", "c", "k1", {"z": 5}),
             ("edge", "d", "a", "r", {})]
    ours, theirs = LinkGraph(example=3, tau=0.1), nx.MultiDiGraph(example=3, tau=0.1)
    for call in calls:
        for g in (ours, theirs):
            if call[0] == "node":
                g.add_node(call[1], **call[2])
            else:
                g.add_edge(call[1], call[2], key=call[3], **call[4])
    ours.nodes["b"]["late"] = True
    theirs.nodes["b"]["late"] = True
    assert ("c" in ours) and ("e" not in ours)
    assert json.dumps(ours.node_link_data()) == json.dumps(nx.node_link_data(theirs, edges="edges"))


def test_stored_routes_are_networkx_node_link_data():
    """Each prompt's stored route text is what networkx writes for the graph it reads back."""
    m = load_model("demo")
    result = InformationFlowRoutes(tau=0.04).run(m, es.tasks.ioi(n=3, seed=1), quiet=True)
    texts = result.extra["graphs"].columns.read(0, 3, ["graph"])["graph"]
    for text in texts:
        g = nx.node_link_graph(json.loads(text), edges="edges")
        assert g.number_of_edges() > 0
        assert json.dumps(nx.node_link_data(g, edges="edges")) == text


@pytest.mark.parametrize("granularity", ["head", "token"])
def test_moved_importance_is_the_routes_attention_edges_from_earlier_tokens_into_the_last_position(granularity):
    """moved_importance_mean per component: summed here from each prompt's saved route graph (attention edges whose
    target is the last position's node and whose source token is earlier), 0 where a route has none, averaged over
    the prompts; MLPs move nothing between tokens."""
    m = load_model("demo")
    result = InformationFlowRoutes(tau=0.04, granularity=granularity).run(m, es.tasks.ioi(n=6, seed=3), quiet=True)
    graphs = list(result.extra["graphs"])
    for _, row in result.table.iterrows():
        moved = []
        for g in graphs:
            last = g.graph["position"]
            moved.append(sum(d["importance"] for u, v, d in g.edges(data=True)
                             if d["component"] == row.component and d["kind"] == "attention"
                             and g.nodes[v]["position"] == last and g.nodes[u]["position"] < last))
        assert row.moved_importance_mean == pytest.approx(sum(moved) / len(moved), abs=1e-6)
        assert row.moved_importance_mean_ci_low <= row.moved_importance_mean + 1e-9
    assert (result.table[result.table.kind == "mlp"].moved_importance_mean == 0).all()
    assert (result.table.moved_importance_mean > 0).any()


def test_the_lead_names_routes_into_the_prediction_and_says_the_always_on_components_once():
    m = load_model("demo")
    result = InformationFlowRoutes(tau=0.04).run(m, es.tasks.ioi(n=6, seed=3), quiet=True)
    text, t = str(result.takeaway), result.table
    top = t.sort_values("moved_importance_mean", ascending=False, kind="stable").head(6)
    assert text.startswith("Routes into the prediction from earlier tokens")
    said = text.split("Always on")[0]
    named = sorted((said.index(f"{c} "), c) for c in t.component if f"{c} " in said)
    assert [c for _, c in named] == list(top.component)  # the six largest, in order, and no other
    always = int((t.in_route >= 1).sum())
    assert f"Always on, said once: {always} of {len(t)} components are on every prompt's route" in text
    assert text.count("Always on") == 1
