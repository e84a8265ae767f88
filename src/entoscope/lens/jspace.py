"""Sparse nonnegative decomposition of an activation into Jacobian-lens vectors (Gurnee et al. 2026).

The lens vectors at layer l are the rows of W_U^T J[l] (row t: J[l]^T W_U[:, t], the direction of block l's
output that the lens reads as token t). `decompose(x, dictionary, k)` writes x as a nonnegative combination
of at most k of them: greedy selection (the atom of largest correlation with the residual, atoms taken at
unit norm so that scale does not decide) with a nonnegative least-squares re-solve of every selected
coefficient after each selection; it stops early when no unselected atom is positively correlated with
the residual (under nonnegativity such an atom cannot reduce it), so k is an upper bound. Both supports
are returned: `selected` (every chosen atom) and `support` (those with a nonzero coefficient), with the
reconstruction and its relative error ||x - reconstruction|| / ||x||. The rule is TransformerLens 4.3's
`get_sparse_decomposition` default (nonnegative orthogonal matching pursuit); a test compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError

TOL = 1e-6  # relative to ||x||: a correlation or an atom's contribution below it counts as zero


@dataclass(frozen=True)
class Decomposition:
    support: list[int]  # atoms with a nonzero coefficient, in selection order
    coefficients: list[float]  # aligned with support, > 0
    selected: list[int]  # every selected atom (support is a subset)
    reconstruction: Tensor  # [d_model]
    error: float  # ||x - reconstruction|| / ||x||


def decompose(x: Tensor, dictionary: Tensor, k: int = 25) -> Decomposition:
    """x [d_model] as a k-sparse nonnegative combination of the rows of dictionary [atoms, d_model]."""
    from scipy.optimize import nnls

    if dictionary.ndim != 2 or x.ndim != 1 or x.shape[0] != dictionary.shape[1]:
        raise ConfigError(f"decompose takes x [d] and a dictionary [atoms, d]; got {tuple(x.shape)} and "
                          f"{tuple(dictionary.shape)}", code="decompose_shape", remedy="pass one activation vector")
    if not 1 <= k <= dictionary.shape[0]:
        raise ConfigError(f"k must lie in 1..{dictionary.shape[0]}, got {k}", code="decompose_shape",
                          remedy="e.g. k=25")
    target = x.detach().double().cpu()
    atoms = dictionary.detach().double().cpu()
    norms = atoms.norm(dim=1)
    x_norm = float(target.norm())
    residual = target.clone()
    selected: list[int] = []
    coef = np.zeros(0)
    for _ in range(k):
        corr = (atoms @ residual) / norms
        if selected:
            corr[selected] = -torch.inf
        best = int(corr.argmax())
        if float(corr[best]) <= TOL * x_norm:
            break
        selected.append(best)
        A = atoms[selected].T.numpy()
        coef, _ = nnls(A, target.numpy())
        residual = target - torch.from_numpy(A @ coef)
    active = [i for i, c in enumerate(coef) if c * float(norms[selected[i]]) > TOL * x_norm]
    support = [selected[i] for i in active]
    values = [float(coef[i]) for i in active]
    rec = atoms[support].T @ torch.tensor(values, dtype=torch.float64) if support else torch.zeros_like(target)
    error = float((target - rec).norm() / x_norm) if x_norm > 0 else 0.0
    return Decomposition(support, values, selected, rec.float(), error)
