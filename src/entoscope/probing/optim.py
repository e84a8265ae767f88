"""Batched second-order and quasi-Newton minimisers for many independent smooth convex problems.

A problem batch is an object with
    value(theta)      -> f          f: [*B]        (theta: [*B, M])
    value_grad(theta) -> (f, g)     g: [*B, M]
    hessian(theta)    -> H          H: [*B, M, M]  (Newton only)
where the leading batch dims *B index independent problems (sites, label sets, ...). Nothing is
shared between problems: every problem has its own step length, its own L-BFGS memory and its own
stopping test, so one hard problem does not slow or spoil the others (optimising the *sum* of the
objectives with one shared line search would couple them).

Stopping test, per problem: max_j |g_j| <= tol * max_j |g_j(theta = 0)|, i.e. the gradient is
`tol` times smaller than at the origin. A problem whose line search can no longer decrease the
objective (the floating-point floor) stops and is reported by its `converged` flag.

Compaction: once at most half the problems of the batch still iterate, the batch is cut down to
those (`problem.subset(mask)` returns a problem over the masked ones, batch shape [1, B']), so a
few slow problems (weak regularisation) do not pay for the finished ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_C1 = 1e-4  # Armijo sufficient-decrease constant
_MAX_HALVINGS = 40


@dataclass
class OptResult:
    theta: torch.Tensor  # [*B, M]
    converged: torch.Tensor  # [*B] bool: gradient test met
    n_iter: torch.Tensor  # [*B] int: iterations taken
    grad_max: torch.Tensor  # [*B] final max |g|


def _bcast(v: torch.Tensor) -> torch.Tensor:
    return v.unsqueeze(-1)


def _threshold(problem, theta: torch.Tensor, tol: float) -> torch.Tensor:
    _, g0 = problem.value_grad(torch.zeros_like(theta))
    return tol * g0.abs().amax(-1)


def _line_search(problem, theta, f, d, slope, t0, active):
    """Backtracking (Armijo) per problem. Returns step t (0 where none was found), f at the step, failed mask."""
    t = torch.where(active, t0, torch.zeros_like(t0))
    done = ~active
    f_new = f.clone()
    # Near the optimum the predicted decrease falls below the rounding of f: accept a step that
    # does not increase f beyond that rounding (otherwise Newton would stall one step short).
    noise = 64 * torch.finfo(f.dtype).eps * f.abs().clamp_min(1.0)
    for _ in range(_MAX_HALVINGS):
        ft = problem.value(theta + _bcast(t) * d)
        ok = (ft <= f + _C1 * t * slope) | ((-slope * t <= noise) & (ft <= f + noise))
        ok = ok & torch.isfinite(ft)
        newly = ok & ~done
        f_new = torch.where(newly, ft, f_new)
        done = done | ok
        if bool(done.all()):
            break
        t = torch.where(done, t, 0.5 * t)
    failed = ~done
    t = torch.where(failed, torch.zeros_like(t), t)
    return t, f_new, failed


class _Tracker:
    """Maps a (possibly compacted) working batch back to the original problems."""

    def __init__(self, theta: torch.Tensor):
        self.shape, M = theta.shape[:-1], theta.shape[-1]
        B = theta[..., 0].numel()
        self.sel = torch.arange(B, device=theta.device)
        self.theta = theta.reshape(B, M).clone()
        self.gmax = torch.zeros(B, dtype=theta.dtype, device=theta.device)
        self.n_iter = torch.zeros(B, dtype=torch.int64, device=theta.device)

    def store(self, theta, gmax, n_iter):
        self.theta[self.sel] = theta.reshape(-1, theta.shape[-1])
        self.gmax[self.sel] = gmax.reshape(-1)
        self.n_iter[self.sel] = n_iter.reshape(-1)

    def maybe_compact(self, problem, active, state: dict, lists: dict):
        """Store everything, then keep only the active problems (if at most half are)."""
        n_active, n = int(active.sum()), active.numel()
        if n < 2 or 2 * n_active > n or n_active == 0 or not hasattr(problem, "subset"):
            return problem, active, state, lists
        self.store(state["theta"], state["gmax"], state["n_iter"])
        keep = active.reshape(-1)
        self.sel = self.sel[keep]
        nb = active.ndim

        def cut(x):
            return x.reshape(-1, *x.shape[nb:])[keep][None]

        problem = problem.subset(active)
        state = {k: cut(v) for k, v in state.items()}
        lists = {k: [cut(v) for v in vs] for k, vs in lists.items()}
        return problem, cut(active), state, lists

    def result(self, theta, gmax, n_iter, thresh) -> OptResult:
        self.store(theta, gmax, n_iter)
        gm = self.gmax.reshape(self.shape)
        return OptResult(self.theta.reshape(*self.shape, -1), gm <= thresh, self.n_iter.reshape(self.shape), gm)


def _newton_direction(H: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """-H^-1 g by Cholesky; a growing jitter where H is not numerically positive definite, and
    steepest descent as a last resort."""
    L, info = torch.linalg.cholesky_ex(H)
    if bool((info != 0).any()):
        eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
        scale = H.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-30)
        for k in range(-12, 1, 2):
            bad = info != 0
            if not bool(bad.any()):
                break
            Lj, info_j = torch.linalg.cholesky_ex(H + (bad * scale * 10.0**k)[..., None, None] * eye)
            L = torch.where(bad[..., None, None], Lj, L)
            info = torch.where(bad, info_j, info)
    d = -torch.cholesky_solve(_bcast(g), L).squeeze(-1)
    return torch.where(_bcast(info != 0), -g, d)


def newton(problem, theta0: torch.Tensor, *, tol: float = 1e-8, max_iter: int = 100) -> OptResult:
    """Damped Newton: Cholesky-solved Newton direction, backtracking line search, per problem."""
    theta = theta0.clone()
    thresh_full = _threshold(problem, theta, tol)
    f, g = problem.value_grad(theta)
    gmax = g.abs().amax(-1)
    active = gmax > thresh_full
    n_iter = torch.zeros_like(gmax, dtype=torch.int64)
    track = _Tracker(theta)
    st = {"theta": theta, "f": f, "g": g, "gmax": gmax, "n_iter": n_iter, "thresh": thresh_full}
    lists: dict = {}
    for _ in range(max_iter):
        if not bool(active.any()):
            break
        problem, active, st, lists = track.maybe_compact(problem, active, st, lists)
        theta, f, g = st["theta"], st["f"], st["g"]
        d = _newton_direction(problem.hessian(theta), g) * _bcast(active)
        slope = (g * d).sum(-1)
        t, _, failed = _line_search(problem, theta, f, d, slope, torch.ones_like(f), active)
        theta = theta + _bcast(t) * d
        f, g = problem.value_grad(theta)
        gmax = g.abs().amax(-1)
        st.update(theta=theta, f=f, g=g, gmax=gmax, n_iter=st["n_iter"] + active.to(torch.int64))
        active = active & ~failed & (gmax > st["thresh"])
    return track.result(st["theta"], st["gmax"], st["n_iter"], thresh_full)


def lbfgs(
    problem, theta0: torch.Tensor, *, tol: float = 1e-8, max_iter: int = 5000, history: int = 20
) -> OptResult:
    """Limited-memory BFGS with a per-problem memory, step length and stopping test.

    Curvature pairs with s.y <= 0 (possible with a backtracking line search) are not stored for
    that problem (their rho is 0, so they drop out of the two-loop recursion).
    """
    theta = theta0.clone()
    thresh_full = _threshold(problem, theta, tol)
    f, g = problem.value_grad(theta)
    gmax = g.abs().amax(-1)
    active = gmax > thresh_full
    track = _Tracker(theta)
    st = {
        "theta": theta, "f": f, "g": g, "gmax": gmax, "thresh": thresh_full,
        "n_iter": torch.zeros_like(gmax, dtype=torch.int64),
        "gamma": torch.ones_like(f),
        # first step: unit length along -g, scaled to at most 1 (as torch.optim.LBFGS)
        "t0": torch.clamp(1.0 / g.abs().sum(-1).clamp_min(1e-30), max=1.0),
    }
    hist: dict = {"S": [], "Y": [], "R": []}
    for _ in range(max_iter):
        if not bool(active.any()):
            break
        problem, active, st, hist = track.maybe_compact(problem, active, st, hist)
        theta, f, g, gamma = st["theta"], st["f"], st["g"], st["gamma"]
        S, Y, R = hist["S"], hist["Y"], hist["R"]
        q = g.clone()
        alphas = []
        for s, y, rho in zip(reversed(S), reversed(Y), reversed(R)):
            a = rho * (s * q).sum(-1)
            q = q - _bcast(a) * y
            alphas.append(a)
        r = _bcast(gamma) * q
        for s, y, rho, a in zip(S, Y, R, reversed(alphas)):
            b = rho * (y * r).sum(-1)
            r = r + _bcast(a - b) * s
        d = -r
        slope = (g * d).sum(-1)
        not_descent = ~(slope < 0)
        d = torch.where(_bcast(not_descent), -g, d)
        slope = torch.where(not_descent, -(g * g).sum(-1), slope)
        d = d * _bcast(active)
        t, _, failed = _line_search(problem, theta, f, d, slope, st["t0"], active)
        step = _bcast(t) * d
        theta = theta + step
        f_prev = f
        f, g_new = problem.value_grad(theta)
        yv = g_new - g
        sy = (step * yv).sum(-1)
        yy = (yv * yv).sum(-1)
        ok = active & (sy > 1e-12 * yy.sqrt() * step.norm(dim=-1)) & (yy > 0)
        S.append(step)
        Y.append(yv)
        R.append(torch.where(ok, 1.0 / torch.where(ok, sy, torch.ones_like(sy)), torch.zeros_like(sy)))
        if len(S) > history:
            S.pop(0), Y.pop(0), R.pop(0)
        gmax = g_new.abs().amax(-1)
        st.update(
            theta=theta, f=f, g=g_new, gmax=gmax, n_iter=st["n_iter"] + active.to(torch.int64),
            gamma=torch.where(ok, sy / torch.where(ok, yy, torch.ones_like(yy)), gamma), t0=torch.ones_like(f),
        )
        stalled = failed | ((f_prev - f <= 0) & (gmax > st["thresh"]) & ~ok)
        active = active & ~stalled & (gmax > st["thresh"])
    return track.result(st["theta"], st["gmax"], st["n_iter"], thresh_full)
