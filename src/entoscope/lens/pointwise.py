"""Pointwise activations whose backward is one multiply: for fits that run many backwards through one forward.

An activation written as a formula (GPT-2's `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) is
a chain of a dozen tensor ops, and autograd replays the chain's backward, op by op over the whole
[cotangents, batch, positions, d_mlp] gradient, on every backward call. An elementwise function's Jacobian
is diagonal, f'(x): inside `folded_activations`, such a module's forward also computes f'(x) once (autograd
of the module's own forward, with a cotangent of ones), and its backward is g * f'(x). Values are the
module's own; gradients equal the chain's to float32 rounding.

Which modules are elementwise is data: the activation classes of HuggingFace's table (`ACT2CLS`) and
torch's elementwise activation modules. A model whose activation is a function rather than a module
(HookedTransformer) is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

_TORCH_POINTWISE: tuple[type[nn.Module], ...] = (
    nn.GELU, nn.SiLU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Hardswish, nn.ELU,
    nn.Softplus, nn.PReLU, nn.Identity)


def pointwise_classes() -> tuple[type[nn.Module], ...]:
    """The module classes treated as elementwise: HuggingFace's activation table and torch's own."""
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # a model without transformers has none of its classes
        return _TORCH_POINTWISE
    hf = tuple(v[0] if isinstance(v, tuple) else v for v in ACT2CLS.values())
    return tuple(dict.fromkeys(hf + _TORCH_POINTWISE))


class _Diagonal(torch.autograd.Function):
    """y = f(x) with f'(x) precomputed: backward g -> g * f'(x)."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, slope: Tensor) -> Tensor:
        return y.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def _folded(forward: Any) -> Any:
    def run(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or not torch.is_grad_enabled() or not x.requires_grad:
            return forward(x, *args, **kwargs)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            y = forward(leaf)
            if y.shape != x.shape:  # not elementwise after all: the module's own graph
                return forward(x)
            # the module's derivative, not a backward through the model: read off the leaf, so that what
            # counts the model's backward passes (torch.autograd.grad) does not count it
            torch.autograd.backward(y, torch.ones_like(y), inputs=[leaf])
            slope = leaf.grad
        return _Diagonal.apply(x, y.detach(), slope)
    return run


@contextmanager
def folded_activations(module: nn.Module) -> Iterator[int]:
    """Inside: every elementwise activation module of `module` backpropagates as one multiply by its
    derivative (computed in its forward). Yields how many modules were folded; restored after."""
    classes = pointwise_classes()
    found = [m for m in module.modules() if isinstance(m, classes) and "forward" not in vars(m)]
    for m in found:
        m.forward = _folded(m.forward)  # type: ignore[method-assign]
    try:
        yield len(found)
    finally:
        for m in found:
            del m.forward
