"""Steering coefficients in units of the site's residual norm (`units: residual_norm`, steering/scale.py) against
independent code: R is the mean L2 norm of run_with_cache's activation over the task prompts' positions with
the BOS left out (numpy on TransformerLens's own cache; on SmolLM2, on transformers' hidden states); the
steered metric is a hand-written run_with_hooks adding c R v / |v|; a run in direction units at c R / |v|
writes the same vector; the coefficients' written norm scales with R, not with the direction's own norm. The
takeaway's words (material, negligible) are checked on tables built by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import entoscope as es
from entoscope.errors import ConfigError
from entoscope.models.adapter import adapt
from entoscope.steering.summary import materiality
from entoscope.steering.takeaway import steering_takeaway

TOL = 1e-4


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _vector(width: int, norm: float, seed: int = 0) -> torch.Tensor:
    v = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


def _hand_norm(model, data, hook: str) -> float:
    """Mean over every task prompt's positions but the BOS of ||x|| at `hook`, from run_with_cache, in numpy."""
    a = adapt(model)
    total, count = 0.0, 0
    for e in data:
        tokens = a.tokenize(e.prompt)
        assert tokens[0] == a.tokenizer.bos_token_id  # the BOS the operation prepends, left out below
        with torch.no_grad():
            _, cache = model.run_with_cache(torch.tensor([tokens]), names_filter=[hook])
        x = cache[hook][0].double().numpy()
        norms = np.linalg.norm(x[1:], axis=-1)
        total, count = total + norms.sum(), count + len(norms)
    return total / count


def test_residual_norm_units_write_c_times_the_hand_measured_norm(demo):
    """R equals the hand-measured mean norm; each row's written_norm is |c| R; the per-prompt metric is a
    hand-written hook adding c R v^ at every position of resid_pre.2."""
    a = adapt(demo)
    data = es.tasks.ioi(n=6, seed=3, tokenizer=a.tokenizer)
    hook = a.hook_name("resid_pre.2")
    v = _vector(a.structure.d_model, 3.0)
    coefficients = [-0.3, 0.2]
    r = es.Steering(direction=es.Direction("resid_pre.2", v), coefficients=coefficients, units="residual_norm",
                    side_effects=None, stats={"n_boot": 0}).run(demo, data, quiet=True)
    R = _hand_norm(demo, data, hook)
    t = r.table
    assert t["residual_norm"].to_numpy() == pytest.approx(np.full(len(t), R), rel=1e-6)
    assert t["written_norm"].to_numpy() == pytest.approx(np.abs(t["coefficient"].to_numpy()) * R, rel=1e-6)
    assert set(t["units"]) == {"residual_norm"}
    pp = r.per_prompt
    pp = pp[(pp.set == "task") & (pp.direction == "direction")]
    unit = (v / v.norm()).double()
    for i, e in enumerate(data):
        tokens = torch.tensor([a.tokenize(e.prompt)])
        ans, wrong = a.token_id(e.answers[0]), a.token_id(e.wrong_answers[0])
        for c in coefficients:
            def add(x, hook, c=c):
                return x + (c * R * unit).to(x.dtype)
            with torch.no_grad():
                logits = demo.run_with_hooks(tokens, fwd_hooks=[(hook, add)])[0, -1].double()
            row = pp[(pp.example == i) & (pp.coefficient == c)].iloc[0]
            assert row.metric == pytest.approx(float(logits[ans] - logits[wrong]), abs=TOL)


def test_the_written_norm_follows_the_site_not_the_direction(demo):
    """The same coefficients with a direction 100 times longer write the same vectors in residual units (the
    same per-prompt metrics), and a run in direction units at c R / |v| writes them too."""
    a = adapt(demo)
    data = {"task": "greater_than", "n": 6, "seed": 7}
    v = _vector(a.structure.d_model, 0.5, seed=1)
    common = dict(side_effects=None, stats={"n_boot": 0}, metric="prob_diff")
    short = es.Steering(direction=es.Direction("resid_pre.1", v), coefficients=[0.25], units="residual_norm",
                        **common).run(demo, data, quiet=True)
    long = es.Steering(direction=es.Direction("resid_pre.1", v * 100), coefficients=[0.25], units="residual_norm",
                       **common).run(demo, data, quiet=True)
    R = float(short.table["residual_norm"].iloc[0])
    absolute = es.Steering(direction=es.Direction("resid_pre.1", v), coefficients=[0.25 * R / float(v.norm())],
                           **common).run(demo, data, quiet=True)
    metric = [r.per_prompt.query("set == 'task' and direction == 'direction'").sort_values("example")["metric"]
              .to_numpy() for r in (short, long, absolute)]
    assert metric[0] == pytest.approx(metric[1], abs=1e-6)
    assert metric[0] == pytest.approx(metric[2], abs=1e-6)
    assert float(long.table["written_norm"].iloc[0]) == pytest.approx(0.25 * R, rel=1e-9)
    assert float(absolute.table["written_norm"].iloc[0]) == pytest.approx(0.25 * R, rel=1e-6)


@pytest.mark.parametrize("extra", [{"normalize": True}, {"mode": "project_out", "coefficients": [1.0]}])
def test_residual_norm_units_refuse_what_has_no_unit(demo, extra):
    op = es.Steering(direction=es.Direction("resid_pre.1", _vector(adapt(demo).structure.d_model, 1.0)),
                     units="residual_norm", side_effects=None, **({"coefficients": [0.1]} | extra))
    with pytest.raises(ConfigError) as err:
        op.plan(demo, {"task": "ioi", "n": 4, "seed": 0})
    assert err.value.code == "steering_units"


def test_old_configs_keep_their_meaning(demo):
    """A config without `units` (an older manifest) is read in direction units: c times the direction as given."""
    op = es.Steering.model_validate({"direction": {"source": "vector", "site": "resid_pre.1",
                                                   "values": [0.0] * 63 + [2.0]}, "coefficients": [0.5]})
    assert op.units == "direction"


# ---------------------------------------------------------------- the words: material, negligible

def _table(effects: list[tuple[float, float, float]], unsteered: float = 0.657) -> pd.DataFrame:
    """A steering table by hand: direction rows at the given (effect, low, high), random rows at 0."""
    K = len(effects)
    coefficients = [0.1 * (k + 1) for k in range(K)]
    rows = []
    for which in ("direction", "random"):
        for c, (e, lo, hi) in zip(coefficients, effects if which == "direction" else [(0.0, -1e-4, 1e-4)] * K):
            rows.append({"condition": f"{which} c={c:g}", "direction": which, "coefficient": c, "mode": "add",
                         "site": "resid_pre.2", "metric": "prob_diff", "direction_norm": 0.78,
                         "metric_unsteered": unsteered, "metric_unsteered_ci_low": unsteered - 0.1,
                         "metric_unsteered_ci_high": unsteered + 0.05, "effect": e, "effect_ci_low": lo,
                         "effect_ci_high": hi, "minus_random": e if which == "direction" else np.nan,
                         "minus_random_ci_low": lo if which == "direction" else np.nan,
                         "minus_random_ci_high": hi if which == "direction" else np.nan,
                         "n_prompts": 16, "n_held_out": 0, "ci_level": 0.95, "negligible_share": 0.05})
    t = pd.DataFrame(rows)
    t["excludes_0"] = (t["effect_ci_low"] > 0) | (t["effect_ci_high"] < 0)
    t["beats_random"] = (t["direction"] == "direction") & t["excludes_0"]
    t["material"], t["negligible"] = materiality(t)
    return t


class _Result:
    def __init__(self, table):
        self.table = table
        self.extra = {"direction_source": "mean_difference", "direction_where": "resid_pre.2"}


def test_an_effect_within_five_percent_of_the_unsteered_metric_is_said_to_be_negligible():
    """SmolLM2's old steering section: +0.003 [0.002, 0.004] on a prob_diff of 0.657 excludes 0, yet is
    under 5% of it (0.033): the lead says negligible first, not 'beats its random baseline'."""
    t = _table([(0.0006, 0.0004, 0.0008), (0.003, 0.002, 0.004)])
    assert t["negligible"].iloc[:2].all() and not t["material"].any()
    text = str(steering_takeaway(_Result(t)))
    assert "negligible at every coefficient" in text and "beats" not in text
    assert "+0.003 [+0.002, +0.004]" in text and "5% of the unsteered prob_diff" in text


def test_the_smallest_material_coefficient_is_named_before_the_others():
    t = _table([(0.01, 0.005, 0.02), (0.05, 0.04, 0.06), (0.2, 0.15, 0.25)])
    band = 0.05 * 0.657
    assert list(t["material"].iloc[:3]) == [False, True, True] and 0.04 > band  # the middle one is the first
    text = str(steering_takeaway(_Result(t)))
    assert "smallest coefficient with a material effect" in text and "c = 0.2: effect +0.05" in text


def test_an_effect_that_excludes_zero_but_reaches_into_the_band_is_neither():
    t = _table([(0.02, 0.01, 0.04)])  # excludes 0, reaches past 0.0329 but not wholly beyond it
    assert not t["material"].iloc[0] and not t["negligible"].iloc[0]
    text = str(steering_takeaway(_Result(t)))
    assert "no coefficient's effect is material" in text and "smallest coefficient whose effect" in text


@pytest.mark.real
def test_on_real_models_residual_norm_units_match_transformers_hidden_states_and_a_pre_hook(real_folder):
    """SmolLM2 and Gemma 3: R is the mean norm of transformers' hidden state entering decoder layer 2
    (hidden_states[2]) over the task prompts' tokens after the BOS; steering at c writes c R v^ there, which a
    forward pre-hook on model.model.layers[2] adding the same vector at every position reproduces (the metric,
    prompt by prompt). On Gemma 3, R is about 1,000: the same c writes a vector a dozen times longer than on
    SmolLM2, whatever the direction's norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_folder)
    hf = AutoModelForCausalLM.from_pretrained(real_folder, dtype=torch.float32).eval()
    data = es.tasks.ioi(n=4, seed=3, tokenizer=tok)
    v = _vector(hf.config.hidden_size, 0.8, seed=2)
    r = es.Steering(direction=es.Direction("resid_pre.2", v), coefficients=[0.1], units="residual_norm",
                    side_effects=None, stats={"n_boot": 0}).run(es.load_model(str(real_folder)), data, quiet=True)

    def ids(text: str) -> torch.Tensor:  # the operation prepends BOS (prepend_bos: true)
        return torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]])

    norms = []
    for e in data:
        with torch.no_grad():
            h = hf(ids(e.prompt), output_hidden_states=True).hidden_states[2][0, 1:].double()
        norms.append(h.norm(dim=-1))
    R = float(torch.cat(norms).mean())
    assert float(r.table["residual_norm"].iloc[0]) == pytest.approx(R, rel=1e-4)
    assert float(r.table["written_norm"].iloc[0]) == pytest.approx(0.1 * R, rel=1e-4)
    add = (0.1 * R * v / v.norm()).float()
    handle = hf.model.layers[2].register_forward_pre_hook(lambda module, args: (args[0] + add, *args[1:]))
    pp = r.per_prompt.query("set == 'task' and direction == 'direction'").set_index("example")
    try:
        for i, e in enumerate(data):
            with torch.no_grad():
                logits = hf(ids(e.prompt)).logits[0, -1].double()
            io, s = (tok(a, add_special_tokens=False).input_ids[0] for a in (e.answers[0], e.wrong_answers[0]))
            assert float(pp.loc[i, "metric"]) == pytest.approx(float(logits[io] - logits[s]), abs=5e-3, rel=1e-3)
    finally:
        handle.remove()
