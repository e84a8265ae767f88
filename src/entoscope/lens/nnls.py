"""Nonnegative least squares: min ||A x - b|| subject to x >= 0, by Lawson and Hanson's active-set method
(Lawson & Hanson 1974, "Solving Least Squares Problems", ch. 23), written here so that the Jacobian-lens
decomposition (jspace.py) needs nothing beyond numpy (scipy is not a dependency of entoscope).

The passive set P holds the coordinates allowed to be positive. Each outer step moves into P the coordinate
whose gradient w = A^T (b - A x) is largest (that is, the one that most reduces the residual when it grows);
the inner loop solves the unconstrained least squares on P and, while that solution has a coordinate <= 0,
steps from x towards it as far as nonnegativity allows and drops the coordinates that reach 0. It stops when
no coordinate outside P has a positive gradient (the KKT conditions: x >= 0, w <= 0 where x = 0, w = 0
where x > 0, to the tolerance). The sub-problems are solved by `numpy.linalg.lstsq` on the columns of P (not the
normal equations, whose conditioning is the square of A's). tests/test_nnls.py checks it against scipy's
solver and against the KKT conditions.
"""

from __future__ import annotations

import numpy as np


def nnls(A: np.ndarray, b: np.ndarray, *, max_iter: int | None = None) -> tuple[np.ndarray, float]:
    """(x, ||A x - b||): the nonnegative least-squares solution of A [m, n] x = b [m] (float64)."""
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = A.shape
    if b.shape != (m,):
        raise ValueError(f"nnls: A is {A.shape} and b {b.shape}; b must have {m} entries")
    # a gradient below a few ulps of |A| |b| counts as zero (Lawson and Hanson's tolerance, made relative to b)
    wtol = 10 * np.finfo(np.float64).eps * max(m, n) * float(np.abs(A).sum(0).max(initial=0.0)) * \
        float(np.linalg.norm(b))
    max_iter = 3 * n if max_iter is None else max_iter
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    shut = np.zeros(n, dtype=bool)  # entered, but their own solve came out <= 0 (rounding): left out until x moves
    w = A.T @ b
    for _ in range(max_iter):
        free = ~passive & ~shut
        if not free.any() or w[free].max() <= wtol:
            break
        j = int(np.flatnonzero(free)[np.argmax(w[free])])
        passive[j] = True
        s = _solve(A, b, passive)
        if s[j] <= 0:
            passive[j] = False
            shut[j] = True
            continue
        while (s[passive] <= 0).any():  # step from x towards s as far as x >= 0 allows; drop what reaches 0
            neg = np.flatnonzero(passive & (s <= 0))
            ratios = x[neg] / (x[neg] - s[neg])
            x = x + float(ratios.min()) * (s - x)
            x[neg[np.argmin(ratios)]] = 0.0
            passive &= x > 0
            x[~passive] = 0.0
            s = _solve(A, b, passive)
        x = np.where(passive, s, 0.0)
        shut[:] = False
        w = A.T @ (b - A @ x)
    return x, float(np.linalg.norm(A @ x - b))


def _solve(A: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    """The unconstrained least-squares solution on the passive columns, 0 elsewhere."""
    s = np.zeros(A.shape[1])
    if passive.any():
        s[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
    return s
