"""Circuits found by their faithfulness (`selection: target`, circuits/search.py), issue 43.

The references: the search's rules on hand-made curves; on the demo model, the faithfulness of EVERY top-n edge set
up to the budget, each evaluated by its own edge-patched run here (so the found size can be checked to be a crossing
of the target, f(n - 1) < target <= f(n)); connectedness by a walk over the kept edges' names written here (no use of
`Circuit.pruned`); the budget's refusal and the lead's words where nothing reaches the target."""

import re

import numpy as np
import pytest

import entoscope as es
from entoscope.circuits.edge_patching import EdgePatcher
from entoscope.circuits.faithfulness import faithfulness, top_n
from entoscope.circuits.search import bracket, next_n, outcome, start_points
from entoscope.errors import ConfigError

TARGET = 0.8


# ---------------------------------------------------------------------- the rules on hand-made curves
def test_bracket_and_next_point_on_hand_made_curves():
    curve = {1: 0.0, 2: 0.1, 5: 0.3, 13: 0.5, 26: 0.9, 52: 1.0}
    assert bracket(curve, TARGET, 52) == (13, 26)
    assert next_n(curve, TARGET, 52) == 19
    assert next_n({**curve, 19: 0.85}, TARGET, 52) == 16  # 19 reaches it: the bracket is (13, 19)
    assert next_n({**curve, 19: 0.6}, TARGET, 52) == 22  # 19 does not: (19, 26)
    assert next_n({**curve, 19: 0.7, 20: 0.85}, TARGET, 52) is None  # (19, 20): settled
    # f need not rise with n: the fewest edges read that reach the target sets the bracket's top
    assert bracket({5: 0.9, 13: 0.5, 26: 0.95}, TARGET, 52) == (0, 5)
    # nothing above the budget counts, and nothing found is no step
    assert bracket({13: 0.5, 26: 0.9}, TARGET, 20) is None
    assert next_n({13: 0.5, 26: 0.9}, TARGET, 20) is None
    assert start_points([0, 2, 13, 26, 262], 20) == [2, 13, 20]


def test_outcome_is_the_top_of_the_bracket_or_the_best_point_read():
    found = outcome([(13, 0.5), (26, 0.9), (19, 0.7), (22, 0.85), (20, 0.81)], TARGET, 52)
    assert found.found and (found.n, found.f) == (20, 0.81)
    none = outcome([(2, 0.1), (5, 0.3), (8, 0.3), (26, 0.95)], TARGET, 8)  # 26 is past the budget
    assert not none.found and (none.n, none.f) == (5, 0.3)  # a tie goes to the fewer edges


# ---------------------------------------------------------------------- the demo model, every top-n set evaluated
@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.fixture(scope="module")
def found(demo):
    op = es.Circuits(method="eap_ig", steps=5, selection="target", faithfulness_target=TARGET, max_edges=52,
                     search_steps=8, faithfulness=[0.01, 0.05, 0.2, 1.0])
    data = {"task": "induction", "n": 16, "seed": 11}
    result = op.run(demo, data, quiet=True)
    prepared = op.prepare_for(demo, data)
    st = prepared.state
    patcher = EdgePatcher(prepared.model, st.graph, st.batches, st.metric)
    scores = result.circuit.scores
    m_full, m_empty = float(patcher.full.mean()), float(patcher.empty.mean())
    per_n = {n: patcher.per_prompt(top_n(st.graph, scores, n)) for n in range(1, 53)}
    f = {n: faithfulness(float(v.mean()), m_empty, m_full) for n, v in per_n.items()}
    return result, f, per_n, patcher


def test_the_circuit_found_is_a_crossing_of_the_target(found):
    result, f, per_n, _ = found
    s = result.summary
    assert s["found"] and s["selection"] == "target" and s["max_edges"] == 52
    n = s["n_top"]
    assert f[n] >= TARGET > f[n - 1], (n, f[n - 1], f[n])  # bisected down to one edge
    assert s["faithfulness"] == pytest.approx(f[n], abs=1e-6)
    assert s["faithfulness_ci_low"] <= s["faithfulness"] <= s["faithfulness_ci_high"]
    # no curve point of fewer edges reaches it (the search starts from the curve's first point that does)
    curve = result.extra["curve"]
    assert not ((curve["n_edges"] < n) & (curve["n_edges"] >= 1) & (curve["faithfulness"] >= TARGET)).any()
    # every point the search read is the top-n set's faithfulness, evaluated here
    for row in result.extra["search"].itertuples():
        assert row.faithfulness == pytest.approx(f[row.n_edges], abs=1e-6)
    np.testing.assert_allclose(result.per_prompt["metric_circuit"], per_n[n].numpy(), rtol=1e-5, atol=1e-6)


def _connected(edges: list[str]) -> bool:
    """Every edge lies on a path input -> ... -> logits through the given edges (a receiver `a1.h0<k>` is read by
    node a1.h0, whose output is sender a1.h0): a walk forward from the input and back from the logits."""
    pairs = [(e.split("->")[0], e.split("->")[1].split("<")[0]) for e in edges]
    forward, back = {"input"}, {"logits"}
    for _ in range(len(pairs) + 1):
        forward |= {r for s, r in pairs if s in forward}
        back |= {s for s, r in pairs if r in back}
    return bool(pairs) and all(s in forward and r in back for s, r in pairs)


def test_the_circuit_found_is_connected_and_gives_the_top_n_sets_output(found):
    result, _, per_n, patcher = found
    t = result.table
    kept = t[t["in_circuit"].astype(bool)]["edge"].tolist()
    assert len(kept) == result.summary["n_kept"] == result.summary["n_kept_pruned"] <= result.summary["n_top"]
    assert _connected(kept)
    # pruning to the connected part changes nothing the model computes
    np.testing.assert_allclose(patcher.per_prompt(result.circuit.kept).numpy(), per_n[result.summary["n_top"]].numpy(),
                               rtol=1e-5, atol=1e-5)
    assert str(result.takeaway).startswith("The smallest circuit the search found to recover at least 0.8")


def test_no_circuit_within_the_budget_is_said_and_not_drawn(demo, tmp_path):
    op = es.Circuits(method="eap", selection="target", faithfulness_target=0.99, max_edges=8, search_steps=4,
                     faithfulness=[0.01, 0.02, 0.2, 1.0])
    data = {"task": "ioi", "n": 8, "seed": 3}
    result = op.run(demo, data, quiet=True)
    s = result.summary
    prepared = op.prepare_for(demo, data)
    st = prepared.state
    patcher = EdgePatcher(prepared.model, st.graph, st.batches, st.metric)
    m_full, m_empty = float(patcher.full.mean()), float(patcher.empty.mean())
    read = {n: faithfulness(patcher.mean(top_n(st.graph, result.circuit.scores, n)), m_empty, m_full)
            for n in (2, 5, 8)}  # the curve's points of at most 8 edges (262 x 0.01, 0.02) and the budget's
    assert max(read.values()) < 0.99
    assert not s["found"] and s["search_points"] == 3
    assert s["n_top"] == max(read, key=lambda n: (read[n], -n))
    assert s["faithfulness"] == pytest.approx(read[s["n_top"]], abs=1e-6)
    assert str(result.takeaway).startswith("No circuit of 8 edges or fewer reaches the target faithfulness 0.99")
    titles = [title for title, _ in result.figures()]
    assert titles and all(t.startswith("faithfulness") for t in titles)  # the curve, no drawing of a circuit
    # the star names the set the lead names (the top n) and what is left of it after pruning (the edges kept)
    star = next(t for t in result.figures()[0][1].data if t.marker.symbol == "star")
    kept = int(result.circuit.kept.sum())
    assert star.name.startswith(f"best edge set read: the top {s['n_top']:,} edges")
    assert (f", {kept:,} after pruning (" in star.name) == (kept != s["n_top"])
    folder = result.save(tmp_path / "none")
    assert (folder / "search.csv").exists() and (folder / "faithfulness.csv").exists()


def test_the_search_reuses_one_patcher_and_stays_within_its_plan(demo, monkeypatch):
    """The search's steps read the patched runs of the faithfulness phase's patcher (no new clean and corrupt runs a
    step), and it evaluates no more circuits than its plan counts."""
    from entoscope.circuits import operation

    made, evaluated = [], []
    real_init, real_eval = EdgePatcher.__init__, EdgePatcher.per_prompt

    def init(self, *a, **k):
        made.append(1)
        real_init(self, *a, **k)

    def per_prompt(self, kept):
        evaluated.append(int(kept.sum()))
        return real_eval(self, kept)
    monkeypatch.setattr(operation.EdgePatcher, "__init__", init)
    monkeypatch.setattr(operation.EdgePatcher, "per_prompt", per_prompt)
    op = es.Circuits(method="eap", selection="target", max_edges=52, search_steps=6, faithfulness=[0.05, 0.2, 1.0])
    result = op.run(demo, {"task": "induction", "n": 8, "seed": 11}, quiet=True)
    assert len(made) == 1
    patched = len(evaluated)  # the curve's 13 and 52 (1.0 is the clean run), then the steps
    assert patched == 2 + (result.summary["search_points"] - 2)
    assert 8 * (2 + patched) <= result.plan.forward_passes - 8 * 3  # EAP's 3 runs a prompt come first


def test_target_refusals_before_any_work(demo):
    with pytest.raises(ConfigError) as e:
        es.Circuits(method="acdc", selection="target").plan(demo, {"task": "induction", "n": 2})
    assert e.value.code == "target_needs_scores"
    with pytest.raises(ConfigError) as e:
        es.Circuits(selection="target", max_edges=10_000).plan(demo, {"task": "induction", "n": 2})
    assert e.value.code == "too_many_edges"


@pytest.mark.real
@pytest.mark.slow
def test_on_smollm2_a_circuit_shown_is_connected_and_meets_its_target_or_none_is_said(smollm2_folder):
    model = es.load_model(str(smollm2_folder))
    op = es.Circuits(method="eap", selection="target", max_edges=706, search_steps=3, faithfulness=[0.005, 0.01, 1.0])
    result = op.run(model, {"task": "ioi", "n": 4, "seed": 11}, quiet=True)
    s = result.summary
    if s["found"]:
        kept = result.table[result.table["in_circuit"].astype(bool)]["edge"].tolist()
        assert _connected(kept) and s["faithfulness"] >= s["faithfulness_target"]
        assert result.figures()[0][0].startswith("circuit:")
    else:
        assert str(result.takeaway).startswith("No circuit of 706 edges or fewer reaches the target")
        assert all(title.startswith("faithfulness") for title, _ in result.figures())
    read = np.concatenate([result.extra["curve"]["faithfulness"].to_numpy(float),
                           result.extra["search"]["faithfulness"].to_numpy(float)])
    assert np.isfinite(read).all() and s["search_points"] >= 2


def test_where_none_is_found_the_lead_says_where_the_curve_first_reaches_the_target(demo):
    op = es.Circuits(method="eap", selection="target", max_edges=20, faithfulness=[0.01, 0.05, 0.2, 0.5, 1.0])
    result = op.run(demo, {"task": "induction", "n": 8, "seed": 1}, quiet=True)
    curve = result.extra["curve"]
    assert not result.summary["found"]
    first = curve[curve["faithfulness"] >= TARGET].sort_values("n_edges").iloc[0]
    assert first["n_edges"] > 20
    assert f"curve first reaches it at {int(first['n_edges']):,} edges" in str(result.takeaway)


def test_edge_clearance_skips_only_obstacles_that_clear_by_their_bounding_box():
    """The drawing's clearance (circuits/edge_paths.py) leaves out obstacles outside the polyline's bounding box by
    more than their clearance; against every obstacle measured (written here), it says the same where any is too
    close (the same smallest margin) and clears where none is."""
    from entoscope.circuits.edge_paths import Canvas, clearance_px

    rng = np.random.default_rng(0)
    canvas = Canvas(37.0, 52.0)

    def brute(xs, ys, obstacles):
        best = np.inf
        for ox, oy, c in obstacles:
            q = np.array([ox * canvas.sx, oy * canvas.sy])
            for i in range(len(xs) - 1):
                a = np.array([xs[i] * canvas.sx, ys[i] * canvas.sy])
                b = np.array([xs[i + 1] * canvas.sx, ys[i + 1] * canvas.sy])
                t = np.clip(np.dot(q - a, b - a) / max(np.dot(b - a, b - a), 1e-12), 0, 1)
                best = min(best, float(np.linalg.norm(q - (a + t * (b - a)))) - c)
        return best
    for _ in range(300):
        k = int(rng.integers(2, 6))
        xs, ys = np.cumsum(rng.normal(0, 1, k)), np.cumsum(rng.normal(0, 1, k))
        obstacles = np.column_stack([rng.uniform(-4, 4, 30), rng.uniform(-4, 4, 30), rng.choice([6.0, 12.0], 30)])
        fast, slow = clearance_px(xs, ys, obstacles, canvas), brute(xs, ys, obstacles)
        assert (fast >= 0) == (slow >= 0)
        if slow < 0:
            assert fast == pytest.approx(slow, abs=1e-9)


def test_a_fixed_size_circuit_with_no_path_from_the_input_to_the_logits_says_so(demo):
    """SmolLM2's top-20 circuits held no path from the input to the logits and were described as the circuit; a
    fixed-size circuit whose edges all fall off every such path now says so before what it recovers."""
    result = es.Circuits(method="eap_ig", steps=5, n_edges=1, faithfulness=[0.5, 1.0]).run(
        demo, {"task": "induction", "n": 8, "seed": 11}, quiet=True)
    kept = result.table[result.table["in_circuit"].astype(bool)]["edge"].tolist()
    assert len(kept) == 1 and not _connected(kept) and result.summary["n_kept_pruned"] == 0
    assert re.search(r"none of them on a path from the input to the logits and recovers -?0\.00 \[", str(result.takeaway))


def test_the_curves_budget_label_sits_on_the_budget_line_of_its_log_axis(demo):
    """On a log axis plotly reads an annotation's x as log10 of the value: the budget's label must sit at the
    budget's own fraction (max_edges / n_edges_total), as its dashed line does."""
    op = es.Circuits(method="eap", selection="target", max_edges=20, faithfulness=[0.01, 0.05, 0.2, 1.0])
    result = op.run(demo, {"task": "induction", "n": 4, "seed": 1}, quiet=True)
    s = result.summary
    fig = next(f for title, f in result.figures() if title.startswith("faithfulness"))
    assert fig.layout.xaxis.type == "log"
    line = next(shape for shape in fig.layout.shapes if shape.type == "line" and shape.x0 == shape.x1)
    label = next(a for a in fig.layout.annotations if a.text.startswith("budget"))
    assert line.x0 == pytest.approx(s["max_edges"] / s["n_edges_total"])
    assert 10 ** label.x == pytest.approx(line.x0)
