"""Attribution patching and integrated gradients against gradients taken by hand with TransformerLens
hooks, against exact patching (completeness, a model linear in the patched activation), and each other."""

import pytest
import torch

import entoscope as es
from entoscope.models import adapt, load_model
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_tokenizer, tokenizer_dir
from entoscope.patching import Patching

from conftest import needs_hooked
from test_patching import BACKENDS, random_pairs, same_length

RESID1 = es.Sites(activation="resid_pre", over=["layer", "position"], layers=[1])


def estimate(result):
    """The method's estimate of m(patched) - m(base), [prompts, units]."""
    return result.extra["patched"] - result.extra["m_base"][:, None]


def ioi_batch(model, k=3, seed=3):
    a = adapt(model)
    data = same_length(es.tasks.ioi(n=24, seed=seed), k, model)
    tok = {key: torch.tensor([a.tokenize(getattr(e, key)) for e in data]) for key in ("prompt", "counterfactual")}
    ans = torch.tensor([a.token_id(e.answers[0]) for e in data])
    wrong = torch.tensor([a.token_id(e.wrong_answers[0]) for e in data])
    return data, tok, ans, wrong


def grad_by_hand(model, tokens, name, ans, wrong, replace=None):
    """d(sum of logit differences)/d(activation `name`), optionally with the activation replaced first."""
    store = {}

    def hook(x, hook):
        x = (replace if replace is not None else x).detach().clone().requires_grad_(True)
        store["x"] = x
        return x
    logits = model.run_with_hooks(tokens, fwd_hooks=[(name, hook)])
    rows = torch.arange(len(tokens))
    (logits[rows, -1, ans] - logits[rows, -1, wrong]).sum().backward()
    return store["x"].detach(), store["x"].grad.detach()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda v: f"{v[0]}{'-compat' if v[1] else ''}")
def test_attribution_is_gradient_times_difference_and_ig_bounds_it(backend):
    model = load_model("demo", backend=backend[0], compat=backend[1])
    data, tok, ans, wrong = ioi_batch(model)
    name = "blocks.1.hook_resid_pre"
    _, clean = model.run_with_cache(tok["prompt"])
    base, grad = grad_by_hand(model, tok["counterfactual"], name, ans, wrong)  # denoising: the corrupt run
    by_hand = ((clean[name] - base) * grad).sum(-1).double()  # [prompts, positions]
    attribution = Patching(sites=RESID1, method="attribution").run(model, data, quiet=True)
    torch.testing.assert_close(estimate(attribution), by_hand, atol=2e-4, rtol=1e-4)
    # integrated gradients: one left point is the gradient at the base run (attribution, another code path) ...
    left = Patching(sites=RESID1, method="integrated_gradients", ig_steps=1, ig_rule="left").run(model, data,
                                                                                                  quiet=True)
    torch.testing.assert_close(estimate(left), by_hand, atol=2e-4, rtol=1e-4)
    # ... and one right point is the gradient at the fully patched layer (every position's clean value)
    patched, grad_end = grad_by_hand(model, tok["counterfactual"], name, ans, wrong, replace=clean[name])
    right = Patching(sites=RESID1, method="integrated_gradients", ig_steps=1, ig_rule="right").run(model, data,
                                                                                                    quiet=True)
    torch.testing.assert_close(estimate(right), ((clean[name] - base) * grad_end).sum(-1).double(),
                               atol=2e-4, rtol=1e-4)
    assert (estimate(right) - estimate(left)).abs().max() > 0.1  # the two ends really differ


def test_integrated_gradients_completeness():
    """Over every element of one activation, the estimates sum to the exact effect of patching all of it.
    Stated tolerance: midpoint rule, 32 points: |sum - exact| <= 1e-3 |exact| + 1e-3; the error falls
    as 1/m^2 (halving the step cuts it about 4x); attribution alone is much further off here."""
    model = load_model("demo")
    data, *_ = ioi_batch(model)
    for kind, over in (("resid_pre", ["layer", "position"]), ("z", ["layer", "head"])):
        sites = es.Sites(activation=kind, over=over, layers=[1])
        whole = Patching(sites=es.Sites(activation=kind, over=["layer"], layers=[1]), comparison="difference"
                         ).run(model, data, quiet=True)
        exact = estimate(whole)[:, 0]
        errors = {}
        for steps in (16, 32):
            ig = Patching(sites=sites, method="integrated_gradients", ig_steps=steps).run(model, data, quiet=True)
            errors[steps] = (estimate(ig).sum(1) - exact).abs()
        assert (errors[32] <= 1e-3 * exact.abs() + 1e-3).all(), (kind, errors[32], exact)
        if kind == "resid_pre":
            assert (errors[16] / errors[32]).min() > 3
            attribution = Patching(sites=sites, method="attribution").run(model, data, quiet=True)
            assert (estimate(attribution).sum(1) - exact).abs().max() > 10 * errors[32].max()


@needs_hooked
def test_attribution_is_exact_where_the_model_is_linear():
    """A float64 tiny GPT-2 whose final norm has eps = 1e10: the scale is then constant and the logits are
    linear in the last layer's residual stream and MLP output, but not in anything before the last MLP."""
    model = from_hf(tiny_hf_model("gpt2").double(), tiny_tokenizer(), backend="hooked", name="linear-head",
                    folder=tokenizer_dir())
    model.ln_final.eps = 1e10
    data = random_pairs(3, [7], seed=2)

    def relative_error(kind, layer):
        sites = es.Sites(activation=kind, layers=[layer], over=["layer", "position"])
        exact = estimate(Patching(sites=sites, comparison="difference").run(model, data, quiet=True))
        approx = estimate(Patching(sites=sites, method="attribution").run(model, data, quiet=True))
        assert exact.abs().max() > 0
        return float((approx - exact).abs().max() / exact.abs().max())

    assert relative_error("mlp_out", 1) < 1e-8
    assert relative_error("resid_post", 1) < 1e-8
    assert relative_error("resid_pre", 0) > 1e-2  # upstream of attention and MLPs: not linear


def test_attribution_of_head_results_equals_that_of_their_z():
    """result_h = z_h W_O[h]: its gradient is attn_out's, z's is attn_out's times W_O[h]^T: the same number."""
    model = load_model("demo")
    data, *_ = ioi_batch(model)
    over = ["layer", "head", "position"]
    by_z = Patching(sites=es.Sites(activation="z", over=over), method="attribution").run(model, data, quiet=True)
    by_result = Patching(sites=es.Sites(activation="result", over=over), method="attribution").run(model, data,
                                                                                                 quiet=True)
    assert estimate(by_z).abs().max() > 1e-2
    torch.testing.assert_close(estimate(by_result), estimate(by_z), atol=1e-4, rtol=1e-4)


def test_attribution_on_a_frozen_model_and_of_ablations():
    model = load_model("demo")
    data, tok, ans, wrong = ioi_batch(model)
    sites = es.Sites(activation="mlp_out", over=["layer", "position"])
    free = Patching(sites=sites, method="attribution", patch="zero", direction="noising").run(model, data, quiet=True)
    for p in model.parameters():
        p.requires_grad_(False)
    frozen = Patching(sites=sites, method="attribution", patch="zero", direction="noising").run(model, data, quiet=True)
    torch.testing.assert_close(estimate(frozen), estimate(free))
    # zero ablation: delta = -activation, gradient on the clean run
    base, grad = grad_by_hand(model, tok["prompt"], "blocks.2.hook_mlp_out", ans, wrong)
    torch.testing.assert_close(estimate(free)[:, -base.shape[1]:], (-base * grad).sum(-1).double(),
                               atol=2e-4, rtol=1e-4)


@needs_hooked
def test_integrated_gradients_starting_at_each_layer_equals_full_forwards():
    model = load_model("demo", backend="hooked")
    data = random_pairs(4, [7, 9], seed=8)  # mixed lengths
    for sites in (es.Sites(activation="z", groups=[[{"layer": 0, "head": 2}, {"layer": 2, "head": 1, "pos": -1}]]),
                  es.Sites(activation="mlp_out", over=["layer", "position"], positions=[-1, 2])):
        runs = [Patching(sites=sites, method="integrated_gradients", ig_steps=3, prefix_reuse=reuse, batch_size=5,
                         comparison="difference").run(model, data, quiet=True) for reuse in ("layers", "off")]
        assert "start at the first changed layer" in str(runs[0].plan)
        assert estimate(runs[1]).abs().max() > 1e-3
        torch.testing.assert_close(estimate(runs[0]), estimate(runs[1]), atol=1e-4, rtol=1e-4)
