"""Remove the span of a few directions from activations (the causal check of a probe direction)."""

from __future__ import annotations

import torch

from ..errors import DataError


def orthonormal_basis(directions: torch.Tensor, *, rtol: float = 1e-10) -> torch.Tensor:
    """[k, D] -> [r, D] orthonormal rows spanning the same space (r = numerical rank, via QR).

    A direction that lies (to rtol) in the span of the earlier ones has a negligible diagonal
    entry in R; its Q column is then arbitrary and is dropped.
    """
    if directions.ndim == 1:
        directions = directions[None]
    if directions.ndim != 2:
        raise DataError(f"directions must be [k, D] or [D], got shape {tuple(directions.shape)}")
    dt = torch.float32 if directions.device.type == "mps" else torch.float64
    A = directions.to(dt).T  # [D, k]
    Q, R = torch.linalg.qr(A, mode="reduced")
    diag = R.diagonal().abs()
    scale = A.norm(dim=0).clamp_min(torch.finfo(dt).tiny)
    keep = diag > rtol * scale
    return Q[:, keep].T


def project_out(x: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """x [..., D] minus its component in span(directions [k, D]): x - (x Q) Q^T.

    Orthonormalised first, so directions need not be unit or orthogonal. Returns x's dtype.
    """
    B = orthonormal_basis(directions.to(x.device))
    if B.shape[-1] != x.shape[-1]:
        raise DataError(f"directions have {B.shape[-1]} features, activations {x.shape[-1]}")
    Bx = B.to(x.dtype)
    return x - (x @ Bx.T) @ Bx
