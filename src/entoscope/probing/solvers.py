"""Batched probe solvers: L2-regularised logistic regression (binary, multinomial) and ridge.

Objectives (the same minimisers as scikit-learn, so coefficients can be compared):

  logistic, binary      C * sum_i log(1 + exp(-s_i (w . z_i + b)))  + 0.5 ||w||^2,  s_i = +-1
  logistic, multinomial C * sum_i -log softmax(W z_i + b)[y_i]      + 0.5 ||W||_F^2 (K vectors)
  ridge                 sum_i (y_i - w . z_i - b)^2                 + alpha ||w||^2

= sklearn LogisticRegression(C=C, l1_ratio=0 [penalty="l2"], fit_intercept=True) and
Ridge(alpha=alpha, fit_intercept=True). Intercepts are not penalised. The multinomial intercepts
are defined up to a common shift (softmax ignores it); we return the representative with
sum_k b_k = 0, which is the one sklearn's lbfgs reaches from its zero start.

Internally the logistic objective is divided by C * n (a mean loss plus 0.5 / (C n) ||W||^2):
same minimiser, gradients of order one whatever n and C.

Shapes: features Z [S, n, D] (S sites, n rows, already standardised), labels [n] or [L, n] (L
label sets sharing the features, e.g. the real task and its control): problems are [L, S].
Everything runs on Z's device and dtype.

When D > n the problem is solved in the n-dimensional row space of Z (exact: the penalised
optimum lies in that span; see _RowSpace), then mapped back. Probes on a few hundred
prompts with 768+ features are then Newton problems of size ~n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError
from . import optim

HESSIAN_MEMORY = 2**30  # bytes: "auto" never builds Newton Hessians larger than this in all


def choose_solver(n_problems: int, n: int, M: int, device: torch.device) -> str:
    """Pick "newton" or "lbfgs" by a cost model (flops, per batch of problems).

    A Newton iteration costs ~ 2 n M^2 (Hessian) + M^3 / 3 (Cholesky) per problem; an L-BFGS
    iteration ~ 12 n M (about three loss-and-gradient evaluations) per problem plus a fixed
    per-iteration overhead (Python and kernel launches: ~1 ms, worth ~2e7 flops on a CPU core and
    far more on a GPU). Newton wins if it is cheaper than ~10 L-BFGS iterations (warm-started
    L-BFGS needed 5-60x more iterations than Newton in our measurements). Measured on one CPU
    thread: binary, n=120, M=121: Newton ~ L-BFGS; multinomial K=4 (M=484): L-BFGS 5x faster;
    binary n=600, M=601: L-BFGS 2.6x faster.
    """
    if n_problems * M * M * 8 * 3 > HESSIAN_MEMORY:
        return "lbfgs"
    overhead = 1e11 if device.type == "cuda" else 2e7
    newton = n_problems * (2.0 * n * M * M + M**3 / 3)
    lbfgs = 10 * (n_problems * 12.0 * n * M + overhead)
    return "newton" if newton <= lbfgs else "lbfgs"


@dataclass
class LinearSolution:
    """One fitted linear map per problem: scores = Z @ coef^T + intercept."""

    coef: torch.Tensor  # [L, S, K, D]  K = 1 (binary, regression) or n_classes
    intercept: torch.Tensor  # [L, S, K]
    converged: torch.Tensor  # [L, S] bool
    n_iter: torch.Tensor  # [L, S]
    theta: torch.Tensor | None = None  # [L, S, M] solver state (reduced space), for warm starts


def shared_matmul(Z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Z [S, n, D] times W [L, S, K, D]^T -> [L, S, n, K], without copying Z L times.

    (A broadcast matmul would expand Z to [L, S, n, D]; folding L and K into the columns keeps
    it one batched matmul over S.)
    """
    L, S, K, D = W.shape
    out = Z @ W.permute(1, 3, 0, 2).reshape(S, D, L * K)  # [S, n, L*K]
    return out.unflatten(-1, (L, K)).permute(2, 0, 1, 3)


def shared_tmatmul(Z: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Z [S, n, D]^T times R [L, S, n, K] -> [L, S, K, D] (the transpose product, same folding)."""
    L, S, n, K = R.shape
    out = Z.mT @ R.permute(1, 2, 0, 3).reshape(S, n, L * K)  # [S, D, L*K]
    return out.unflatten(-1, (L, K)).permute(2, 0, 3, 1)


def _weighted_gram(A: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A [S, n, Q], h [L, S, n] -> A^T diag(h_l) A  [L, S, Q, Q], one matmul over S."""
    L, S, n = h.shape
    Q = A.shape[-1]
    hA = (h.permute(1, 2, 0)[..., None] * A[:, :, None, :]).reshape(S, n, L * Q)
    return (A.mT @ hA).unflatten(-1, (L, Q)).permute(2, 0, 1, 3)


class _Binary:
    """Mean-scaled binary logistic loss. theta [L, S, P + 1] = (w, b)."""

    def __init__(self, Z: torch.Tensor, t: torch.Tensor, lam: torch.Tensor):
        self.t, self.lam, self.n = t[:, None, :], lam, Z.shape[-2]  # lam: [L, S]
        self.A = torch.cat([Z, torch.ones_like(Z[..., :1])], -1)  # [S, n, Q]

    def subset(self, mask: torch.Tensor) -> "_Binary":
        """The problems where mask [L, S] is true, as one batch [1, B'] (see optim)."""
        li, si = mask.nonzero(as_tuple=True)
        new = object.__new__(_Binary)
        new.n, new.A = self.n, self.A[si]
        new.t = self.t.expand(*mask.shape, self.n)[li, si][None]
        new.lam = self.lam.expand(mask.shape)[li, si][None]
        return new

    def _m(self, theta):
        return shared_matmul(self.A, theta[..., None, :])[..., 0]  # [L, S, n]

    def _f(self, theta, m):
        w = theta[..., :-1]
        return (torch.nn.functional.softplus(m) - self.t * m).mean(-1) + 0.5 * self.lam * (w * w).sum(-1)

    def value(self, theta):
        return self._f(theta, self._m(theta))

    def value_grad(self, theta):
        m = self._m(theta)
        r = (torch.sigmoid(m) - self.t) / self.n  # [L, S, n]
        g = shared_tmatmul(self.A, r[..., None])[..., 0, :]  # [L, S, Q]
        reg = self.lam[..., None] * theta
        reg[..., -1] = 0
        return self._f(theta, m), g + reg

    def hessian(self, theta):
        p = torch.sigmoid(self._m(theta))
        H = _weighted_gram(self.A, p * (1 - p) / self.n)
        mask = torch.ones(self.A.shape[-1], dtype=H.dtype, device=H.device)
        mask[-1] = 0
        return H + self.lam[..., None, None] * torch.diag(mask)


class _Multinomial:
    """Mean-scaled softmax cross-entropy. theta [L, S, K * (P + 1)], per class (w_k, b_k).

    The term 0.5 * (sum_k b_k)^2 is added: the loss is flat along a common intercept shift, so it
    changes no minimum value, only picks the sum-zero intercepts and keeps the Hessian definite.
    """

    def __init__(self, Z: torch.Tensor, y: torch.Tensor, K: int, lam: torch.Tensor):
        self.K, self.lam, self.n = K, lam, Z.shape[-2]  # lam: [L, S]
        self.A = torch.cat([Z, torch.ones_like(Z[..., :1])], -1)  # [S, n, Q]
        self.Y = torch.nn.functional.one_hot(y, K).to(Z.dtype)[:, None]  # [L, 1, n, K]
        self.Q = Z.shape[-1] + 1

    def subset(self, mask: torch.Tensor) -> "_Multinomial":
        """The problems where mask [L, S] is true, as one batch [1, B'] (see optim)."""
        li, si = mask.nonzero(as_tuple=True)
        new = object.__new__(_Multinomial)
        new.K, new.Q, new.n, new.A = self.K, self.Q, self.n, self.A[si]
        new.Y = self.Y.expand(*mask.shape, self.n, self.K)[li, si][None]
        new.lam = self.lam.expand(mask.shape)[li, si][None]
        return new

    def _T(self, theta):
        return theta.unflatten(-1, (self.K, self.Q))  # [L, S, K, Q] = (W | b)

    def _f(self, T, logp):
        ce = -(self.Y * logp).sum(-1).mean(-1)
        W, b = T[..., :-1], T[..., -1]
        return ce + 0.5 * self.lam * (W * W).sum((-1, -2)) + 0.5 * b.sum(-1) ** 2

    def value(self, theta):
        T = self._T(theta)
        return self._f(T, torch.log_softmax(shared_matmul(self.A, T), -1))

    def value_grad(self, theta):
        T = self._T(theta)
        logp = torch.log_softmax(shared_matmul(self.A, T), -1)  # [L, S, n, K]
        R = (logp.exp() - self.Y) / self.n
        G = shared_tmatmul(self.A, R)  # [L, S, K, Q]
        reg = self.lam[..., None, None] * T
        reg[..., -1] = T[..., -1].sum(-1, keepdim=True)  # gradient of 0.5 (sum_k b_k)^2
        return self._f(T, logp), (G + reg).flatten(-2)

    def hessian(self, theta):
        T = self._T(theta)
        p = torch.softmax(shared_matmul(self.A, T), -1)  # [L, S, n, K]
        A, K, Q, n = self.A, self.K, self.Q, self.n
        L, S = p.shape[:2]
        # (1/n) sum_i (diag(p_i) - p_i p_i^T) (x) a_i a_i^T
        diag_blocks = _weighted_gram(A, (p / n).permute(0, 3, 1, 2).reshape(L * K, S, n))  # [L*K, S, Q, Q]
        diag_blocks = diag_blocks.unflatten(0, (L, K))  # [L, K, S, Q, Q]
        Ap = (p[..., :, None] * A[:, :, None, :]).flatten(-2) / n**0.5  # [L, S, n, K*Q]
        H = -(Ap.mT @ Ap)
        H = H.unflatten(-1, (K, Q)).unflatten(-3, (K, Q))  # [L,S,K,Q,K,Q]
        idx = torch.arange(K, device=H.device)
        H[:, :, idx, :, idx, :] += diag_blocks.permute(1, 0, 2, 3, 4)  # indexed dims go first: [K,L,S,Q,Q]
        H = H.flatten(-2).flatten(-3, -2)
        mask = torch.ones(K, Q, dtype=H.dtype, device=H.device)
        mask[:, -1] = 0
        H = H + self.lam[..., None, None] * torch.diag(mask.flatten())
        bsel = torch.zeros(K, Q, dtype=H.dtype, device=H.device)
        bsel[:, -1] = 1
        bsel = bsel.flatten()
        return H + bsel[:, None] * bsel[None, :]


def _as_label_sets(y: torch.Tensor) -> torch.Tensor:
    return y[None] if y.ndim == 1 else y


class _RowSpace:
    """Exact reduction of a penalised linear problem to the row space of Z [S, n, D] when D > n.

    The loss depends on w only through Z w, and the penalty ||w||^2 is smallest with w in the
    row space, so w = Z^T a. Any F [S, n, n] with F F^T = Z Z^T is then an equivalent design:
    with v = F^T a, Z w = F v and ||w|| = ||v||.

    Fast path: F = Cholesky factor of G = Z Z^T + c 1 1^T (one GEMM). The c 1 1^T term is a
    constant extra feature sqrt(c): standardised training rows are centred, so Z Z^T alone is
    singular. The extra feature changes nothing: its weight is redundant with the unpenalised
    intercept, so the penalised optimum gives it weight 0, and whatever it holds is folded
    exactly into the intercept (`back` returns that shift). When G is ill-conditioned anyway
    (near-duplicate rows), F = R^T from a QR of Z^T, which is stable.
    """

    GRAM_MAX_CONDITION = 1e10  # of G, i.e. 1e5 for the design: well within float64

    def __init__(self, Z: torch.Tensor):
        self.Z = Z
        n = Z.shape[-2]
        G = Z @ Z.mT
        self.c = G.diagonal(dim1=-2, dim2=-1).sum(-1) / n**2  # [S]: sqrt(c) 1 has the rows' mean norm^2
        Lc, info = torch.linalg.cholesky_ex(G + self.c[:, None, None])
        d = Lc.diagonal(dim1=-2, dim2=-1)
        ok = bool((info == 0).all()) and bool((d.amin(-1) ** 2 > d.amax(-1) ** 2 / self.GRAM_MAX_CONDITION).all())
        if ok:
            self.F, self.Q = Lc, None
        else:
            Qm, Rm = torch.linalg.qr(Z.mT, mode="reduced")  # Z^T = Q R, Z = R^T Q^T
            self.F, self.Q = Rm.mT, Qm

    def back(self, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V [L, S, K, n] (weights on F) -> (W [L, S, K, D] weights on Z, intercept shift [L, S, K])."""
        if self.Q is not None:
            return shared_matmul(self.Q, V).mT, torch.zeros_like(V[..., 0])
        L, S, K, n = V.shape
        cols = V.permute(1, 3, 0, 2).reshape(S, n, L * K)
        A = torch.linalg.solve_triangular(self.F.mT, cols, upper=True)  # F^T a = v
        W = (self.Z.mT @ A).unflatten(-1, (L, K)).permute(2, 0, 3, 1)  # [L, S, K, D]
        shift = (self.c[:, None] * A.sum(-2)).unflatten(-1, (L, K)).permute(1, 0, 2)  # [L, S, K]
        return W, shift


class LogisticProbe:
    """Batched L2 logistic regression on one training set, to be fitted at any C.

    Z: [S, n, D] standardised training features; y: int class codes 0..K-1, [n] or [L, n].
    K = 2 fits sklearn's binary model (one vector, positive class = code 1); K >= 3 the
    multinomial one. The row-space reduction (D > n) is done once here, for every later fit.
    solver: "newton" | "lbfgs" | "auto" (by `choose_solver`).
    """

    def __init__(self, Z: torch.Tensor, y: torch.Tensor, *, n_classes: int | None = None,
                 solver: str = "auto", max_iter: int | None = None):
        self.y = _as_label_sets(y).to(Z.device)
        self.K = int(n_classes if n_classes is not None else int(self.y.max()) + 1)
        S, n, D = Z.shape
        self.shape, self.n, self.dtype, self.device = (self.y.shape[0], S), n, Z.dtype, Z.device
        self.reduce = _RowSpace(Z) if D > n else None
        self.Zr = self.reduce.F if self.reduce is not None else Z
        self.P = self.Zr.shape[-1]
        self.n_out = 1 if self.K == 2 else self.K
        self.M = self.n_out * (self.P + 1)
        if solver == "auto":
            solver = choose_solver(self.shape[0] * S, n, self.M, Z.device)
        if solver not in ("newton", "lbfgs"):
            raise ConfigError(f"solver must be 'newton', 'lbfgs' or 'auto', got {solver!r}")
        self.solver = solver
        self.max_iter = max_iter

    def fit(self, C, *, tol: float = 1e-8, init: torch.Tensor | None = None) -> LinearSolution:
        """Fit at C (a number, or one per problem: [L, S]); init: a previous solution's theta."""
        C = torch.as_tensor(C, dtype=self.dtype, device=self.device).expand(self.shape)
        lam = 1.0 / (C * self.n)
        if self.K == 2:
            problem = _Binary(self.Zr, self.y.to(self.dtype), lam)
        else:
            problem = _Multinomial(self.Zr, self.y.long(), self.K, lam)
        theta0 = init if init is not None else torch.zeros(*self.shape, self.M, dtype=self.dtype, device=self.device)
        kw = {"tol": tol} if self.max_iter is None else {"tol": tol, "max_iter": self.max_iter}
        res = (optim.newton if self.solver == "newton" else optim.lbfgs)(problem, theta0, **kw)
        T = res.theta.unflatten(-1, (self.n_out, self.P + 1))
        coef, intercept = T[..., :-1], T[..., -1]
        if self.reduce is not None:
            coef, shift = self.reduce.back(coef)  # [L,S,K,n] -> [L,S,K,D]
            intercept = intercept + shift
        if self.K > 2:
            intercept = intercept - intercept.mean(-1, keepdim=True)
        return LinearSolution(coef, intercept, res.converged, res.n_iter, res.theta)


def logistic_path(
    Z: torch.Tensor,
    y: torch.Tensor,
    Cs: Sequence[float],
    *,
    n_classes: int | None = None,
    solver: str = "auto",
    tol: float = 1e-8,
    max_iter: int | None = None,
) -> list[LinearSolution]:
    """L2 logistic regression for every C in `Cs` (one LinearSolution each, same order); see
    LogisticProbe. Each fit starts from the previous C's solution (give Cs in increasing order
    for the best warm starts)."""
    probe = LogisticProbe(Z, y, n_classes=n_classes, solver=solver, max_iter=max_iter)
    out, theta = [], None
    for C in Cs:
        sol = probe.fit(C, tol=tol, init=theta)
        theta = sol.theta
        out.append(sol)
    return out


def ridge_path(Z: torch.Tensor, y: torch.Tensor, alphas: Sequence[float]) -> list[LinearSolution]:
    """Ridge regression, intercept unpenalised, for every alpha (closed form, one eigendecomposition).

    Z: [S, n, D]; y: float [n] or [L, n]. Solves (Zc^T Zc + alpha I) w = Zc^T yc on the centred
    rows (through the n x n Gram matrix when D > n), b = mean(y) - mean(Z) . w.
    """
    y = _as_label_sets(y).to(device=Z.device, dtype=Z.dtype)
    zbar = Z.mean(-2, keepdim=True)
    Zc = Z - zbar
    ybar = y.mean(-1, keepdim=True)
    yc = (y - ybar)[:, None, :, None]  # [L, 1, n, 1]
    n, D = Z.shape[-2], Z.shape[-1]
    if D <= n:
        evals, V = torch.linalg.eigh(Zc.mT @ Zc)  # [S, D], [S, D, D]
        c = V.mT @ (Zc.mT @ yc)  # [L, S, D, 1]
    else:
        evals, U = torch.linalg.eigh(Zc @ Zc.mT)  # [S, n], [S, n, n]
        c = U.mT @ yc
    evals = evals.clamp_min(0)
    out = []
    for a in alphas:
        scaled = c / (evals[..., None] + float(a))
        w = V @ scaled if D <= n else Zc.mT @ (U @ scaled)  # [L, S, D, 1]
        coef = w.mT  # [L, S, 1, D]
        intercept = ybar[:, None, :] - (zbar[None] @ w).squeeze(-1)  # [L, S, 1]
        L_, S_ = coef.shape[:2]
        ones = torch.ones(L_, S_, dtype=torch.bool, device=Z.device)
        out.append(LinearSolution(coef, intercept, ones, torch.zeros(L_, S_, dtype=torch.int64, device=Z.device)))
    return out
