"""RMS norms whose backward is a closed form: for fits that run many backwards through one forward.

An RMS norm, y = g * x * s with s = (mean_j x_j^2 + eps)^(-1/2) over the last axis (Zhang & Sennrich 2019;
HuggingFace's LlamaRMSNorm, g = weight; GemmaRMSNorm, g = 1 + weight), is written as a chain of ops (pow,
mean, add, rsqrt, two multiplies), and autograd replays the chain's backward, op by op, over the whole batched
gradient on every backward call. Its vector-Jacobian product has the closed form

    dx = s g * dy - (s^3 / d) x (sum_j g_j x_j dy_j)

so inside `folded_norms` such a module's forward also computes a = s g, u = s^3 x / d and v = g x once, and
its backward is a * dy - u (v . dy): two multiplies, a product summed over the last axis, a subtraction.
Values are the module's own; gradients equal the chain's to float32 rounding.

Which modules: those holding one 1-D parameter (`weight`, of the last axis's size) and an epsilon
(`variance_epsilon` or `eps`) and no submodules. The gain g is read off the module itself (its output on a
vector of ones times sqrt(1 + eps)), and each module is checked once, on the first rows it sees, against
autograd of its own forward (the values and one vector-Jacobian product); a module that differs (a LayerNorm,
a norm of another formula) keeps its own backward. Only float32 and float64 inputs are folded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

CHECK_ROWS = 4


class _ClosedForm(torch.autograd.Function):
    """y (the module's own output) with the RMS norm's vector-Jacobian product: dy -> a * dy - u (v . dy)."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, a: Tensor, u: Tensor, v: Tensor) -> Tensor:
        return y.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        ctx.save_for_backward(*inputs[2:])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, u, v = ctx.saved_tensors
        return a * grad - u * (grad * v).sum(-1, keepdim=True), None, None, None, None


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return float(eps)
    return None


def _candidate(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    weight = getattr(module, "weight", None)
    return (not list(module.children()) and len(params) == 1 and params[0] is weight and weight.dim() == 1
            and _epsilon(module) is not None and "forward" not in vars(module))


class _Folder:
    """One module's fold: its gain, its epsilon, and whether the closed form reproduces it (checked once)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.forward = module, module.forward
        self.eps = _epsilon(module) or 0.0
        self.gain: Tensor | None = None
        self.ok: bool | None = None

    def parts(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        assert self.gain is not None
        s = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return s * self.gain, x * (s.pow(3) / x.shape[-1]), self.gain * x

    def check(self, x: Tensor) -> bool:
        """The closed form against autograd of the module's own forward on a few of x's rows."""
        d = x.shape[-1]
        try:
            with torch.no_grad():
                self.gain = (self.forward(torch.ones(1, d, dtype=x.dtype, device=x.device))[0]
                             * (1.0 + self.eps) ** 0.5)
            rows = x.detach().reshape(-1, d)[:CHECK_ROWS]
            leaf = rows.clone().requires_grad_(True)
            g = torch.Generator().manual_seed(0)
            cot = torch.randn(rows.shape, generator=g, dtype=x.dtype).to(x.device)
            with torch.enable_grad():
                y = self.forward(leaf)
                if y.shape != rows.shape:
                    return False
                # read off the leaf, not torch.autograd.grad: what counts the model's backward passes ignores it
                torch.autograd.backward(y, cot, inputs=[leaf])
            a, u, v = self.parts(rows)
            want_y, want_dx = y.detach(), leaf.grad
            got_y = rows * a
            got_dx = a * cot - u * (cot * v).sum(-1, keepdim=True)
            assert want_dx is not None
            return bool(torch.allclose(got_y, want_y, rtol=1e-4, atol=1e-6 * float(want_y.abs().max()) + 1e-12)
                        and torch.allclose(got_dx, want_dx, rtol=1e-4,
                                           atol=1e-5 * float(want_dx.abs().max()) + 1e-12))
        except (RuntimeError, TypeError, ValueError):
            return False

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if (args or kwargs or not torch.is_grad_enabled() or not isinstance(x, Tensor) or not x.requires_grad
                or x.dtype not in (torch.float32, torch.float64)):
            return self.forward(x, *args, **kwargs)
        if self.ok is None:
            self.ok = self.check(x)
        if not self.ok:
            return self.forward(x)
        with torch.no_grad():
            y = self.forward(x)
            a, u, v = self.parts(x)
        return _ClosedForm.apply(x, y, a, u, v)


@contextmanager
def folded_norms(module: nn.Module) -> Iterator[int]:
    """Inside: every RMS norm of `module` (see the module docstring) backpropagates by its closed form.
    Yields how many modules were candidates; each is checked on its first use; restored after."""
    found = [m for m in module.modules() if _candidate(m)]
    for m in found:
        m.forward = _Folder(m)  # type: ignore[method-assign]
    try:
        yield len(found)
    finally:
        for m in found:
            del m.forward
