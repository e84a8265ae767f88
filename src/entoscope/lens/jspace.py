"""Sparse nonnegative decomposition of an activation into Jacobian-lens vectors (Gurnee et al. 2026).

The lens vectors at layer l are the rows of W_U^T J[l] (row t: J[l]^T W_U[:, t], the direction of block l's
output that the lens reads as token t). `decompose(x, dictionary, k)` writes x as a nonnegative combination
of at most k of them: greedy selection (the atom of largest correlation with the residual, atoms taken at
unit norm so that scale does not decide) with a nonnegative least-squares re-solve of every selected
coefficient after each selection; it stops early when no unselected atom is positively correlated with
the residual (under nonnegativity such an atom cannot reduce it), so k is an upper bound. Both supports
are returned: `selected` (every chosen atom) and `support` (those with a nonzero coefficient), with the
reconstruction and its relative error ||x - reconstruction|| / ||x||. The rule is TransformerLens 4.3's
`get_sparse_decomposition` default (nonnegative orthogonal matching pursuit), computed in float64 (the NNLS:
nnls.py, Lawson-Hanson); TransformerLens computes in float32, so where two atoms' correlations with the residual
tie to float32 rounding the two may select different atoms (and go on differently from there); away from such
near-ties they select the same atoms (a test compares the two on lens vectors).
`decompose_many` decomposes many activations against one dictionary (`Atoms`: made float64 once), one matrix
product per greedy step for all of them (coordinate patching's prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError
from .nnls import nnls

TOL = 1e-6  # relative to ||x||: a correlation or an atom's contribution below it counts as zero


@dataclass(frozen=True)
class Decomposition:
    support: list[int]  # atoms with a nonzero coefficient, in selection order
    coefficients: list[float]  # aligned with support, > 0
    selected: list[int]  # every selected atom (support is a subset)
    reconstruction: Tensor  # [d_model]
    error: float  # ||x - reconstruction|| / ||x||


@dataclass(frozen=True)
class Atoms:
    """A dictionary made ready once for many decompositions: its rows in float64 on the CPU and their norms."""

    rows: Tensor  # [atoms, d_model] float64
    norms: Tensor  # [atoms]

    @classmethod
    def of(cls, dictionary: Tensor | Atoms) -> Atoms:
        if isinstance(dictionary, Atoms):
            return dictionary
        if dictionary.ndim != 2:
            raise ConfigError(f"a dictionary is [atoms, d]; got {tuple(dictionary.shape)}", code="decompose_shape",
                              remedy="pass the lens vectors of one layer")
        rows = dictionary.detach().double().cpu()
        return cls(rows, rows.norm(dim=1))


def decompose(x: Tensor, dictionary: Tensor | Atoms, k: int = 25) -> Decomposition:
    """x [d_model] as a k-sparse nonnegative combination of the rows of dictionary [atoms, d_model]."""
    if x.ndim != 1:
        raise ConfigError(f"decompose takes x [d]; got {tuple(x.shape)}", code="decompose_shape",
                          remedy="pass one activation vector (decompose_many takes [n, d])")
    return decompose_many(x[None], dictionary, k)[0]


def decompose_many(X: Tensor, dictionary: Tensor | Atoms, k: int = 25) -> list[Decomposition]:
    """Each row of X [n, d_model] decomposed as `decompose` does, one matrix product per greedy step for all rows."""
    atoms = Atoms.of(dictionary)
    if X.ndim != 2 or X.shape[1] != atoms.rows.shape[1]:
        raise ConfigError(f"decompose takes x [n, d] and a dictionary [atoms, d]; got {tuple(X.shape)} and "
                          f"{tuple(atoms.rows.shape)}", code="decompose_shape", remedy="pass activation vectors")
    if not 1 <= k <= atoms.rows.shape[0]:
        raise ConfigError(f"k must lie in 1..{atoms.rows.shape[0]}, got {k}", code="decompose_shape",
                          remedy="e.g. k=25")
    target = X.detach().double().cpu()
    x_norm = target.norm(dim=1).tolist()
    residual = target.clone()
    selected: list[list[int]] = [[] for _ in range(len(target))]
    coefs = [np.zeros(0) for _ in range(len(target))]
    active = list(range(len(target)))
    for _ in range(k):
        if not active:
            break
        corr = (residual[active] @ atoms.rows.T) / atoms.norms
        still = []
        for j, i in enumerate(active):
            c = corr[j]
            if selected[i]:
                c[selected[i]] = -torch.inf
            best = int(c.argmax())
            if float(c[best]) <= TOL * x_norm[i]:
                continue
            selected[i].append(best)
            A = atoms.rows[selected[i]].T.numpy()
            coefs[i], _ = nnls(A, target[i].numpy())
            residual[i] = target[i] - torch.from_numpy(A @ coefs[i])
            still.append(i)
        active = still
    return [_result(target[i], atoms, selected[i], coefs[i], x_norm[i]) for i in range(len(target))]


def _result(target: Tensor, atoms: Atoms, selected: list[int], coef: np.ndarray, x_norm: float) -> Decomposition:
    active = [i for i, c in enumerate(coef) if c * float(atoms.norms[selected[i]]) > TOL * x_norm]
    support = [selected[i] for i in active]
    values = [float(coef[i]) for i in active]
    rec = atoms.rows[support].T @ torch.tensor(values, dtype=torch.float64) if support else torch.zeros_like(target)
    error = float((target - rec).norm() / x_norm) if x_norm > 0 else 0.0
    return Decomposition(support, values, selected, rec.float(), error)
