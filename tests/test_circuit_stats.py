"""Edge-score intervals, faithfulness / CPR / CMD intervals and circuit stability, against brute force
over per-prompt values computed independently (each prompt scored on its own)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.circuits.eap import edge_scores
from entoscope.circuits.faithfulness import cmd, cpr
from entoscope.circuits.graph import ComponentGraph
from entoscope.data.tokenized import make_batches, pad_id, tokenize_data
from entoscope.metrics import Metric
from entoscope.models import adapt
from entoscope.stats import Stats, mean_stat, resample_weights, summarise
from entoscope.stats.bootstrap import expanded_alpha


@pytest.fixture(scope="module")
def run():
    model = es.load_model("demo")
    data = es.tasks.induction(n=10, seed=3)
    op = es.Circuits(method="eap", n_edges=12, stability=40, faithfulness=[0.05, 0.2, 1.0],
                     stats={"n_boot": 300, "ci_method": "expanded_percentile"}, seed=5)
    return model, data, op, op.run(model, data, quiet=True)


def _alone(model, data):
    """Each prompt's EAP scores, run as its own batch: [E, S, R]."""
    a = adapt(model)
    td = tokenize_data(a, data, pairs=True, answers=True)
    out = []
    for b in make_batches(td, 1, pad_id(a)):
        out.append(edge_scores(a, [b], Metric(type="logit_diff").function(), method="eap", quiet=True))
    order = [b.index[0] for b in make_batches(td, 1, pad_id(a))]
    stacked = torch.stack(out)
    result = torch.empty_like(stacked)
    result[torch.tensor(order)] = stacked
    return result


def _brute_percentile(values: np.ndarray, stat, W: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval from resampled datasets written out row by row (np.repeat), no weights."""
    boots = np.stack([stat(values[np.repeat(np.arange(len(values)), w.astype(int))]) for w in W])
    alpha = expanded_alpha(level, len(values))
    return np.quantile(boots, alpha, axis=0), np.quantile(boots, 1 - alpha, axis=0)


def test_edge_score_intervals_resample_the_per_prompt_scores(run):
    model, data, op, result = run
    graph = ComponentGraph.from_structure(adapt(model).structure)
    per = _alone(model, data)
    order = graph.mask.T.nonzero()
    values = per[:, order[:, 1], order[:, 0]].double().numpy()
    t = result.table.sort_index()
    by_edge = result.table.set_index("edge")
    names = [e.name for e in graph.edges()]
    np.testing.assert_allclose(by_edge.loc[names, "score"].to_numpy(), values.mean(0), atol=1e-4)
    W = resample_weights(len(data), 300, op.seed)
    low, high = _brute_percentile(values, lambda x: x.mean(0), W, 0.95)
    np.testing.assert_allclose(by_edge.loc[names, "score_ci_low"].to_numpy(), low, atol=1e-4)
    np.testing.assert_allclose(by_edge.loc[names, "score_ci_high"].to_numpy(), high, atol=1e-4)
    assert {"score_q", "significant", "ci_level"} <= set(t.columns)


def test_faithfulness_and_cpr_intervals_by_brute_force(run):
    model, data, op, result = run
    pp = result.per_prompt
    clean, corrupt, circ = (pp[c].to_numpy(float) for c in ("metric_clean", "metric_corrupt", "metric_circuit"))
    X = np.column_stack([circ, clean, corrupt])
    f = lambda x: np.array([(x[:, 0].mean() - x[:, 2].mean()) / (x[:, 1].mean() - x[:, 2].mean())])  # noqa: E731
    W = resample_weights(len(data), 300, op.seed)
    low, high = _brute_percentile(X, f, W, 0.95)
    s = result.summary
    assert s["faithfulness"] == pytest.approx(f(X)[0], abs=1e-6)
    assert s["faithfulness_ci_low"] == pytest.approx(low[0], abs=1e-6)
    assert s["faithfulness_ci_high"] == pytest.approx(high[0], abs=1e-6)
    curve = result.extra["curve"]
    assert s["cpr"] == pytest.approx(cpr(list(curve.fraction), list(curve.faithfulness)))
    assert s["cmd"] == pytest.approx(cmd(list(curve.fraction), list(curve.faithfulness)))
    assert s["cpr_ci_low"] <= s["cpr"] <= s["cpr_ci_high"] and s["cmd_ci_low"] <= s["cmd"] <= s["cmd_ci_high"]
    assert (curve.faithfulness_ci_low <= curve.faithfulness + 1e-9).all()
    # the point keeping every edge is read from the clean run (nothing patched); a patched run of it agrees
    from entoscope.circuits.edge_patching import EdgePatcher
    from entoscope.circuits.graph import ComponentGraph as Graph
    from entoscope.data.tokenized import make_batches, pad_id, tokenize_data

    a = adapt(model)
    graph = Graph.from_structure(a.structure)
    patcher = EdgePatcher(a, graph, make_batches(tokenize_data(a, data, pairs=True, answers=True), 4, pad_id(a)),
                          Metric(type="logit_diff").function())
    np.testing.assert_allclose(patcher.per_prompt(graph.mask).numpy(), clean, atol=1e-4)
    assert curve.faithfulness.iloc[-1] == 1.0


def test_stability_inclusion_and_jaccard_by_brute_force(run):
    model, data, op, result = run
    graph = ComponentGraph.from_structure(adapt(model).structure)
    per = _alone(model, data)
    E = len(data)
    W = resample_weights(E, op.stability, op.seed)
    names = [e.name for e in graph.edges()]
    order = graph.mask.T.nonzero()
    circuits = []
    for w in W:
        idx = np.repeat(np.arange(E), w.astype(int))
        mean = per[idx].mean(0)[order[:, 1], order[:, 0]].abs().numpy()
        best = np.argsort(-mean, kind="stable")[: op.n_edges]
        circuits.append({names[i] for i in best})
    inclusion = np.array([np.mean([n in c for c in circuits]) for n in names])
    by_edge = result.table.set_index("edge")
    np.testing.assert_allclose(by_edge.loc[names, "inclusion"].to_numpy(), inclusion, atol=1e-9)
    pairs = [(i, j) for i in range(len(circuits)) for j in range(len(circuits)) if i != j]
    jac = np.mean([len(circuits[i] & circuits[j]) / len(circuits[i] | circuits[j]) for i, j in pairs])
    s = result.summary
    assert s["stability_jaccard"] == pytest.approx(jac, abs=1e-6)
    stable = {n for n, v in zip(names, inclusion) if v >= op.stability_share}
    assert set(by_edge.index[by_edge.in_stable_circuit]) == stable and s["n_stable"] == len(stable)
    assert s["stable_faithfulness_ci_low"] <= s["stable_faithfulness"] <= s["stable_faithfulness_ci_high"]


def test_acdc_refuses_stability():
    with pytest.raises(es.EntoscopeError) as err:
        es.Circuits(method="acdc", stability=10).plan(es.load_model("demo"), es.tasks.ioi(n=2))
    assert err.value.code == "stability_needs_scores"


def test_no_bootstrap_leaves_intervals_empty(run):
    model, data, *_ = run
    r = es.Circuits(method="eap", n_edges=5, faithfulness=[], stats={"n_boot": 0}).run(model, data, quiet=True)
    assert r.table.score_ci_low.isna().all() and np.isfinite(r.table.score).all()
    assert np.isnan(summarise(mean_stat(np.ones((3, 1))), Stats(n_boot=0), 0).ci_low).all()


def test_a_senders_summed_score_is_its_kept_edges_per_prompt_scores_summed_then_resampled(run):
    """node_stats (nodes.csv, the drawing's hover): per prompt, the kept edges' scores out of a sender summed;
    its mean over prompts and percentile interval, against the per-prompt scores of each prompt run alone."""
    model, data, op, result = run
    graph = ComponentGraph.from_structure(adapt(model).structure)
    per = _alone(model, data).double().numpy()  # [n, S, R]
    kept = result.circuit.kept.numpy() & graph.mask.numpy()
    summed = (per * kept[None]).sum(2)  # [n, S]
    W = resample_weights(len(data), 300, op.seed)
    low, high = _brute_percentile(summed, lambda x: x.mean(0), W, 0.95)
    nodes = result.extra["node_stats"]
    for i, name in enumerate(graph.senders):
        v, lo, hi = nodes[name]
        assert v == pytest.approx(summed[:, i].mean(), abs=1e-4), name
        assert (lo, hi) == pytest.approx((low[i], high[i]), abs=1e-4), name
    assert sum(abs(nodes[n][0]) > 0 for n in graph.senders) == int(kept.any(1).sum())
