"""The Jacobian lens fit's savings (lens/jacobian_fit.py, lens/pointwise.py, lens/normfold.py): copies of each
prompt carrying one cotangent each, the graph over positions skip_first.. with a frozen key/value prefix,
activations backpropagated as one multiply and RMS norms by their closed form, each checked against an
independent computation (autograd through the model's own full forward, one row at a time; autograd of the
activation's or the norm's own forward)."""

import pytest
import torch
from torch import nn

import entoscope.lens.jacobian_fit as jf
from entoscope.data.tokenized import pad, pad_id
from entoscope.lens.normfold import folded_norms
from entoscope.lens.pointwise import folded_activations, pointwise_classes
from entoscope.models.adapter import Intervention, adapt
from entoscope.models.names import ActName
from entoscope.models.partial import prefix_support

from conftest import get_tiny


def _autograd_rows(a, ids, layer: int, skip: int) -> torch.Tensor:
    """Row i: (1/|V|) sum_{t in V} d (sum_{t' in V} final[t', i]) / d h_layer[t], one row at a time by plain
    torch.autograd.grad through the model's full forward (every position, no prefix, no fold)."""
    L = a.structure.n_layers
    tokens = torch.tensor([ids])
    h0 = a.run(tokens, [ActName("resid_post", layer)]).acts[ActName("resid_post", layer)].detach().requires_grad_()
    iv = Intervention(ActName("resid_post", layer), lambda _: h0)
    final = a.run(tokens, [ActName("resid_post", L - 1)], interventions=[iv], grad=True).acts[
        ActName("resid_post", L - 1)][0]
    V = list(range(skip, len(ids) - 1))
    rows = []
    for i in range(final.shape[-1]):
        (g,) = torch.autograd.grad(final[V, i].sum(), h0, retain_graph=True)
        rows.append(g[0, V].mean(0))
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_suffix_graph_gives_every_source_layer_the_full_forwards_jacobian(family):
    model = get_tiny(family, "bridge", False)
    a = adapt(model)
    assert prefix_support(a) == "positions"  # else the test would check the fallback path only
    g = torch.Generator().manual_seed(1)
    ids = [[0] + torch.randint(1, 300, (n - 1,), generator=g).tolist() for n in (10, 8)]  # right padding too
    tokens, lengths = pad(ids, pad_id(a))
    layers = list(range(a.structure.n_layers - 1))
    with jf.frozen(a.module), folded_activations(a.module), folded_norms(a.module):
        got = jf.prompt_jacobians(a, tokens, lengths, layers, 3, 12)  # 12 copies: 16 = 12 + 4 (+ 8 idle)
    for b, row_ids in enumerate(ids):
        for i, L in enumerate(layers):
            torch.testing.assert_close(got[b, i], _autograd_rows(a, row_ids, L, 3), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_full_graph_gives_the_full_forwards_jacobian_and_never_unembeds(family):
    """skip_first 0 (or a model that cannot start part-way): the graph over every position, ending at the last
    block: the same rows as autograd through the model's own forward, and the unembedding never runs (its
    logits at every position of every copy would sit beside the saved forward: Gemma 3's 1 MiB a position)."""
    model = get_tiny(family, "bridge", False)
    a = adapt(model)
    g = torch.Generator().manual_seed(2)
    ids = [[0] + torch.randint(1, 300, (n - 1,), generator=g).tolist() for n in (9, 7)]
    tokens, lengths = pad(ids, pad_id(a))
    layers = [0, a.structure.n_layers - 2]
    calls = []
    unembed = a.module.get_output_embeddings() if hasattr(a.module, "get_output_embeddings") else None
    unembed = unembed or getattr(a.module, "unembed", None)
    assert unembed is not None
    handle = unembed.register_forward_hook(lambda *args: calls.append(1))
    try:
        with jf.frozen(a.module), folded_activations(a.module), folded_norms(a.module):
            got = jf.prompt_jacobians(a, tokens, lengths, layers, 0, 8)
    finally:
        handle.remove()
    assert calls == []
    for b, row_ids in enumerate(ids):
        for i, L in enumerate(layers):
            torch.testing.assert_close(got[b, i], _autograd_rows(a, row_ids, L, 0), atol=2e-5, rtol=1e-4)


def _constructible() -> list[tuple[type, dict]]:
    """The folded activation classes with the arguments transformers builds them with (those that need
    other arguments, and PReLU with its weight, are left out at collection)."""
    from transformers.activations import ACT2CLS

    found = []
    for cls in pointwise_classes():
        kwargs = next((v[1] for v in ACT2CLS.values() if isinstance(v, tuple) and v[0] is cls), {})
        try:
            cls(**kwargs)
        except TypeError:
            continue
        if cls is not nn.PReLU:
            found.append((cls, kwargs))
    return found


@pytest.mark.parametrize("cls,kwargs", _constructible(), ids=lambda c: getattr(c, "__name__", ""))
def test_a_folded_activation_has_its_own_values_and_derivative(cls, kwargs):
    act = cls(**kwargs)
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 3
    cot = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    x1 = x.clone().requires_grad_()
    want = act(x1)
    (want_grad,) = torch.autograd.grad(want, x1, cot)
    x2 = x.clone().requires_grad_()
    with folded_activations(nn.Sequential(act)) as n:
        got = act(x2)
        (got_grad,) = torch.autograd.grad(got, x2, cot)
    assert n == 1 and "forward" not in vars(act)  # restored
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)


def test_a_folded_activation_backpropagates_batched_cotangents_as_one_multiply():
    from transformers.activations import NewGELUActivation

    act = NewGELUActivation()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    cots = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(3))
    with folded_activations(nn.Sequential(act)):
        y = act(x)
        (got,) = torch.autograd.grad(y, x, cots, is_grads_batched=True)
        assert type(y.grad_fn).__name__ == "_DiagonalBackward"
    # the formula's own derivative, by hand: d/dx 0.5 x (1 + tanh(k (x + 0.044715 x^3)))
    k = (2 / torch.pi) ** 0.5
    v = x.detach()
    u = k * (v + 0.044715 * v ** 3)
    slope = 0.5 * (1 + torch.tanh(u)) + 0.5 * v * (1 - torch.tanh(u) ** 2) * k * (1 + 3 * 0.044715 * v ** 2)
    torch.testing.assert_close(got, cots * slope, atol=1e-6, rtol=1e-5)


def _rms_norms() -> list[tuple[type, float]]:
    """HuggingFace's RMS norm classes of the families entoscope reads (gain = weight, or 1 + weight: Gemma)."""
    import importlib

    found = []
    for module, name in (("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("mistral", "MistralRMSNorm"),
                         ("gemma", "GemmaRMSNorm"), ("gemma3", "Gemma3RMSNorm")):
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        except (ImportError, AttributeError):
            continue
        found.append(cls)
    return found


@pytest.mark.parametrize("cls", _rms_norms(), ids=lambda c: c.__name__)
def test_a_folded_rms_norm_has_its_own_values_and_vector_jacobian_products(cls):
    g = torch.Generator().manual_seed(0)
    norm = cls(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    norm.weight.requires_grad_(False)
    x = torch.randn(3, 5, 24, generator=g) * 3
    cots = torch.randn(4, 3, 5, 24, generator=g)
    x1 = x.clone().requires_grad_()
    want = norm(x1)
    want_grads = [torch.autograd.grad(want, x1, c, retain_graph=True)[0] for c in cots]
    x2 = x.clone().requires_grad_()
    with folded_norms(nn.Sequential(norm)) as n:
        got = norm(x2)
        assert type(got.grad_fn).__name__ == "_ClosedFormBackward"  # folded (its first rows passed the check)
        got_grads = [torch.autograd.grad(got, x2, c, retain_graph=True)[0] for c in cots]
    assert n == 1 and "forward" not in vars(norm)  # restored
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _UncentredLayerNorm(nn.Module):
    """A weight and an epsilon like an RMS norm, but centred: not the closed form's function."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x - x.mean(-1, keepdim=True)
        return self.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_norm_of_another_formula_keeps_its_own_backward():
    norm, ln = _UncentredLayerNorm(16), nn.LayerNorm(16)
    norm.weight.requires_grad_(False)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(4)) + 1.0
    cot = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(5))
    x1 = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(norm(x1), x1, cot)
    x2 = x.clone().requires_grad_()
    with folded_norms(nn.Sequential(norm, ln)) as n:  # the LayerNorm has a bias: not even a candidate
        y = norm(x2)
        assert n == 1 and type(y.grad_fn).__name__ != "_ClosedFormBackward"
        (got,) = torch.autograd.grad(y, x2, cot)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _norm_inputs(model, ids) -> list[tuple[nn.Module, torch.Tensor]]:
    """Every norm module of `model` that a forward of `ids` runs (HuggingFace's RMS norms, torch's LayerNorm, and a
    bridge's wrappers of them, which may run the original or compute the norm themselves), with its input there:
    the model's own activations, not random ones."""
    seen: dict[nn.Module, torch.Tensor] = {}

    def keep(module, args):
        if args and isinstance(args[0], torch.Tensor):
            seen.setdefault(module, args[0].detach().clone())

    norms = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm", "NormalizationBridge"))]
    handles = [m.register_forward_pre_hook(keep) for m in norms]
    try:
        with torch.no_grad():
            adapt(model).run(torch.tensor([ids]), [])
    finally:
        for h in handles:
            h.remove()
    return [(m, seen[m]) for m in norms if m in seen]


def check_norms_against_their_own_autograd(model, ids) -> int:
    """Inside folded_norms: each norm's output and two vector-Jacobian products on its real input equal autograd
    of the module's own forward outside it; RMS norms (class ...RMSNorm) take the closed form, LayerNorms
    (centred, and with a bias) keep their own backward; a bridge's wrapper gives its original's (or its own
    formula's) gradient either way. Returns how many RMS norms were folded."""
    found = _norm_inputs(model, ids)
    assert found, "no norm module ran: the test would check nothing"
    g = torch.Generator().manual_seed(7)
    wants = []
    for m, x in found:  # autograd of the module's own forward, before any fold
        cots = torch.randn((2, *x.shape), generator=g)
        x1 = x.clone().requires_grad_()
        with torch.enable_grad():
            y = m(x1)
            wants.append((y.detach(), [torch.autograd.grad(y, x1, c, retain_graph=True)[0] for c in cots], cots))
    folded = 0
    with jf.frozen(model), folded_norms(model):
        for (m, x), (want_y, want_dx, cots) in zip(found, wants):
            x2 = x.clone().requires_grad_()
            with torch.enable_grad():
                y = m(x2)
                got_dx = [torch.autograd.grad(y, x2, c, retain_graph=True)[0] for c in cots]
            rms = type(m).__name__.endswith("RMSNorm")
            if not type(m).__name__.endswith("Bridge"):
                assert (type(y.grad_fn).__name__ == "_ClosedFormBackward") == rms, type(m).__name__
                folded += rms
            torch.testing.assert_close(y, want_y, atol=0, rtol=0)
            for a, b in zip(got_dx, want_dx):
                scale = float(b.abs().max())
                torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, scale), rtol=1e-4)
    return folded


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
def test_the_tiny_models_norms_fold_to_their_own_backward_on_their_own_activations(family):
    model = get_tiny(family, "bridge", False)
    ids = [0] + torch.randint(1, 300, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    folded = check_norms_against_their_own_autograd(model, ids)
    # GPT-2's are LayerNorms (none folded); Llama's two per block and the final one, Gemma 3's more
    assert folded == 0 if family == "gpt2" else folded >= 2 * model.cfg.n_layers + 1


def test_the_demo_models_layer_norms_keep_their_own_backward():
    import entoscope as es

    demo = es.load_model("demo")
    a = adapt(demo)
    assert check_norms_against_their_own_autograd(demo, a.tokenize("When Mary and John went to the store")) == 0
