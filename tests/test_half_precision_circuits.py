"""Circuit discovery on a bfloat16 model (found by benchmarks/gpu/run.py's CPU path): the once-per-model split
check refused every bfloat16 model (its 1e-3 tolerance is below bfloat16's step of 2^-8), and the
faithfulness metrics came back in bfloat16, which numpy cannot hold. Checked against the same operation on
the same model in float32."""

from __future__ import annotations

import numpy as np
import pytest

import entoscope as es


@pytest.fixture(scope="module")
def runs() -> dict[str, es.Result]:
    data = es.tasks.ioi(n=8, seed=3)
    op = es.Circuits(method="eap", n_edges=20, faithfulness=[0.1, 0.5], stats={"n_boot": 200})
    return {d: op.run(es.load_model("demo", dtype=d), data, quiet=True) for d in ("float32", "bfloat16")}


def test_bfloat16_edge_scores_follow_float32(runs: dict[str, es.Result]) -> None:
    a = runs["float32"].table.set_index("edge")["score"]
    b = runs["bfloat16"].table.set_index("edge")["score"].reindex(a.index)
    assert np.corrcoef(a, b)[0, 1] > 0.99
    top = lambda s: set(s.abs().sort_values(ascending=False).index[:10])  # noqa: E731
    assert len(top(a) & top(b)) >= 8
    assert np.abs(a - b).max() <= 0.05 * a.abs().max()  # bfloat16's step is 0.4%; a few layers add up


def test_bfloat16_faithfulness_is_float32s_within_bfloat16s_error(runs: dict[str, es.Result]) -> None:
    f, h = runs["float32"].extra["summary"], runs["bfloat16"].extra["summary"]
    for key in ("m_full", "m_empty"):
        assert h[key] == pytest.approx(f[key], rel=0.03, abs=0.05), key
    assert h["faithfulness"] == pytest.approx(f["faithfulness"], abs=0.05)
    assert isinstance(h["m_full"], float)  # read in float32 from the model's bfloat16 logits


def test_a_float64_models_circuit_metrics_stay_float64() -> None:
    """The half-precision fix reads metrics in float32; a float64 model's must not be rounded there (it put
    them 7e-8 off). The oracle: the model's own forward (TransformerBridge.__call__, float64) per prompt,
    logit difference at the last token written out. All edges kept is the clean run, to float64's precision;
    the circuits operation's m_full is the oracle's mean and its last curve point's faithfulness is 1."""
    import torch

    from entoscope.circuits.edge_patching import EdgePatcher
    from entoscope.circuits.graph import ComponentGraph
    from entoscope.data.tokenized import make_batches, tokenize_data
    from entoscope.metrics import logit_diff
    from entoscope.models import adapt

    model = es.load_model("demo", dtype="float64")
    data = es.tasks.ioi(n=6, seed=3)
    a = adapt(model)
    td = tokenize_data(a, data, pairs=True, answers=True)
    oracle = []
    for i, ids in enumerate(td.prompts):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1]
        assert logits.dtype == torch.float64
        oracle.append(float(logits[td.answers[i][0]] - logits[td.wrong_answers[i][0]]))
    oracle_t = torch.tensor(oracle, dtype=torch.float64)
    graph = ComponentGraph.from_model(a)
    patcher = EdgePatcher(a, graph, make_batches(td, 3, 0), logit_diff)
    assert patcher.full.dtype == torch.float64 and patcher.empty.dtype == torch.float64
    torch.testing.assert_close(patcher.full, oracle_t, atol=1e-11, rtol=0)
    kept_all = patcher.per_prompt(graph.mask.clone())
    assert kept_all.dtype == torch.float64
    torch.testing.assert_close(kept_all, oracle_t, atol=1e-11, rtol=0)
    result = es.Circuits(method="eap", n_edges=20, faithfulness=[0.1, 1.0], stats={"n_boot": 200}).run(
        model, data, quiet=True)
    summary = result.extra["summary"]
    assert summary["m_full"] == pytest.approx(float(oracle_t.mean()), abs=1e-11, rel=0)
    curve = result.extra["curve"]
    assert list(curve["fraction"]) == [0.1, 1.0]
    assert float(curve["faithfulness"].iloc[-1]) == pytest.approx(1.0, abs=1e-11)


def test_a_float64_models_logit_lens_keeps_float64() -> None:
    """The logit lens of the last layer's resid_post at the last token is the model's own output: on a float64
    model its answer logit and probability equal the model's float64 forward (TransformerBridge.__call__, softmax
    written here) to 1e-12; rounded through float32 they were 1e-7 off."""
    import torch

    from entoscope.data.tokenized import tokenize_data
    from entoscope.models import adapt

    model = es.load_model("demo", dtype="float64")
    data = es.tasks.ioi(n=4)
    table = es.Lens(sites={"activation": "resid_post", "layers": [2], "over": ["layer"]}).run(
        model, data, quiet=True).table
    td = tokenize_data(adapt(model), data, answers=True)
    logit, prob = [], []
    for i, ids in enumerate(td.prompts):
        with torch.no_grad():
            out = model(torch.tensor([ids]))[0, -1]
        logit.append(float(out[td.answers[i][0]]))
        prob.append(float(torch.exp(out - torch.logsumexp(out, -1))[td.answers[i][0]]))
    assert table["target_logit_mean"].iloc[0] == pytest.approx(np.mean(logit), abs=1e-12, rel=0)
    assert table["target_prob_mean"].iloc[0] == pytest.approx(np.mean(prob), abs=1e-12, rel=0)
