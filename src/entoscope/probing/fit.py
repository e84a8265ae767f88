"""fit_probes: one linear probe per site, regularisation chosen on validation rows, scored on test rows.

Pipeline, for each split (one holdout split, or each of k cross-validation splits) and each site:
  1. standardise the features with the mean / std of the training rows only;
  2. fit the probe on the training rows for every value of the grid (C for logistic regression,
     alpha for ridge), strongest regularisation first;
  3. score each on the validation rows (accuracy; ridge: mean squared error) and keep, per site,
     the best, ties going to the stronger regularisation;
  4. that probe (fitted on the training rows only: no refit on train + validation) is scored once
     on the test rows, and on its own training rows (reported as train_*, never as the result).
The control probe (shuffled labels, or one random label per group) goes through the same steps on
the same rows, with its own choice of regularisation. Test labels enter only step 4.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import torch

from ..errors import ConfigError, DataError
from . import metrics as M
from .controls import group_labels, shuffled_labels
from .result import ProbeFit
from .solvers import LinearSolution, LogisticProbe, ridge_path, shared_matmul
from .splits import Split, holdout_split, kfold_splits
from .standardize import Standardizer

DEFAULT_C_GRID = tuple(10.0**e for e in range(-4, 3))  # 1e-4 ... 1e2
DEFAULT_ALPHA_GRID = tuple(10.0**e for e in range(5, -3, -1))  # 1e5 ... 1e-2
MEMORY_BUDGET = 2**30  # bytes of working tensors per chunk of sites


def _as_features(X) -> torch.Tensor:
    if not isinstance(X, torch.Tensor):
        X = torch.as_tensor(np.asarray(X))
    if X.ndim == 2:
        X = X[None]
    if X.ndim != 3:
        raise DataError(
            f"features must be [sites, examples, features], got shape {tuple(X.shape)}",
            remedy="stack one [examples, features] matrix per site along a first axis",
        )
    return X


def _encode_labels(y, task: str):
    y_np = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y)
    if y_np.ndim != 1:
        raise DataError(f"labels must be one-dimensional, got shape {y_np.shape}")
    if task == "classification":
        classes, codes = np.unique(y_np, return_inverse=True)
        if len(classes) < 2:
            raise DataError(
                f"classification needs at least two classes, got {list(classes)}",
                remedy="check the labels, or use task='regression' for a continuous target",
            )
        return torch.from_numpy(codes.reshape(-1).astype(np.int64)), list(classes)
    if task == "regression":
        try:
            yt = torch.from_numpy(y_np.astype(np.float64))
        except (TypeError, ValueError) as e:
            raise DataError(f"regression labels must be numbers: {e}") from None
        if not torch.isfinite(yt).all():
            raise DataError("regression labels contain NaN or infinite values")
        return yt, None
    raise ConfigError(f"task must be 'classification' or 'regression', got {task!r}")


def _make_splits(split, y_codes, *, k, seed, val_fraction, test_fraction, stratify) -> tuple[str, list[Split]]:
    if isinstance(split, str):
        if split == "holdout":
            sp = holdout_split(
                y_codes, val_fraction=val_fraction, test_fraction=test_fraction, seed=seed, stratify=stratify
            )
            return "holdout", [sp]
        if split == "kfold":
            return "kfold", kfold_splits(y_codes, k, seed=seed, stratify=stratify)
        raise ConfigError(f"split must be 'holdout', 'kfold', a Split or a list of Splits, got {split!r}")
    splits = [split] if isinstance(split, Split) else list(split)
    if not splits or not all(isinstance(s, Split) for s in splits):
        raise ConfigError("split must be 'holdout', 'kfold', a Split or a list of Splits")
    return "given", splits


def _check_split(sp: Split, n: int, y_codes, K: int | None, need_val: bool, f: int) -> None:
    idx = torch.cat([sp.train, sp.val, sp.test]).cpu()
    if idx.numel() and (idx.min() < 0 or idx.max() >= n):
        raise DataError(f"split {f}: row indices outside 0..{n - 1}")
    if torch.unique(idx).numel() != idx.numel():
        raise DataError(f"split {f}: train, validation and test rows overlap")
    if sp.train.numel() < 2 or sp.test.numel() == 0 or (need_val and sp.val.numel() == 0):
        raise DataError(
            f"split {f}: {sp.train.numel()} training, {sp.val.numel()} validation, {sp.test.numel()} test rows",
            code="probe_split_too_small",
            remedy="use more examples, fewer folds or larger fractions "
            "(validation rows are needed to choose among several C / alpha)",
        )
    if K is not None:
        present = torch.bincount(y_codes[sp.train.cpu()], minlength=K) > 0
        if not bool(present.all()):
            raise DataError(
                f"split {f}: classes {[int(c) for c in torch.nonzero(~present).flatten()]} have no training rows",
                remedy="use more examples of every class, fewer folds, or drop the rare classes",
            )


def _scores(task: str, K: int, y: torch.Tensor, Z: torch.Tensor, sol: LinearSolution):
    """Metrics of the linear maps in `sol` (coef [L,S,K',D]) on rows Z [S,n,D] with labels y [L,n]."""
    out = shared_matmul(Z, sol.coef) + sol.intercept[..., None, :]  # [L, S, n, K']
    y = y[:, None, :]
    if task == "regression":
        return M.regression_scores(y, out[..., 0])
    return M.classification_scores(y, out[..., 0] if K == 2 else out, K)


def _fit_one_split(Xc, Y, sp: Split, task, K, grid, solve_kw):
    """All sites of a chunk, all label sets, one split. Returns dict of per-[L,S] results."""
    dev = Xc.device
    tr, va, te = sp.train.to(dev), sp.val.to(dev), sp.test.to(dev)
    st = Standardizer.fit(Xc, tr)
    Ztr = st.transform(Xc, tr)
    Zva = st.transform(Xc, va) if va.numel() else None
    Yd = Y.to(dev)
    L, S = Y.shape[0], Xc.shape[0]
    grid_t = torch.as_tensor(grid, dtype=torch.float64, device=dev)
    if task == "classification":
        probe = LogisticProbe(Ztr, Yd[:, tr], n_classes=K, solver=solve_kw["solver"], max_iter=solve_kw["max_iter"])
        path_tol = solve_kw["select_tol"] if len(grid) > 1 else solve_kw["tol"]
        path, theta = [], None
        for C in grid:  # increasing C: each fit warm-starts the next
            sol = probe.fit(C, tol=path_tol, init=theta)
            theta = sol.theta
            path.append(sol)
    else:
        path = ridge_path(Ztr, Yd[:, tr], grid)
    chosen_idx = torch.zeros(L, S, dtype=torch.long, device=dev)
    if len(grid) > 1:
        key = "accuracy" if task == "classification" else "mse"
        sign = 1.0 if task == "classification" else -1.0
        best_score = torch.full((L, S), -math.inf, dtype=torch.float64, device=dev)
        for g, sol in enumerate(path):  # strongest first; a later grid value must be strictly better
            score = sign * _scores(task, K, Yd[:, va], Zva, sol)[key]
            better = score > best_score
            chosen_idx = torch.where(better, torch.full_like(chosen_idx, g), chosen_idx)
            best_score = torch.where(better, score, best_score)
    if task == "classification" and len(grid) > 1:
        # The choice used fits converged to select_tol; the chosen C is now refined to tol,
        # per problem, from its own path solution.
        thetas = torch.stack([sol.theta for sol in path])  # [G, L, S, M]
        init = thetas.gather(0, chosen_idx[None, ..., None].expand(1, L, S, thetas.shape[-1]))[0]
        best = probe.fit(grid_t[chosen_idx], tol=solve_kw["tol"], init=init)
    else:
        pick = lambda name: torch.stack([getattr(sol, name) for sol in path])  # noqa: E731
        idx = chosen_idx[None]
        coef = pick("coef").gather(0, idx[..., None, None].expand(1, *pick("coef").shape[1:]))[0]
        intercept = pick("intercept").gather(0, idx[..., None].expand(1, *pick("intercept").shape[1:]))[0]
        best = LinearSolution(coef, intercept, pick("converged").gather(0, idx)[0], chosen_idx)
    return {
        "train": _scores(task, K, Yd[:, tr], Ztr, best),
        "val": _scores(task, K, Yd[:, va], Zva, best) if Zva is not None else None,
        "test": _scores(task, K, Yd[:, te], st.transform(Xc, te), best),
        "chosen": grid_t[chosen_idx],
        "coef": best.coef,
        "intercept": best.intercept,
        "converged": best.converged,
        "mean": st.mean,
        "std": st.std,
    }


def _chunk_size(S, N, D, L, K_out, dtype) -> int:
    """Sites per chunk so that the features (cast, standardised splits) and per-row scores fit
    MEMORY_BUDGET. (Newton Hessians are bounded separately by solvers.HESSIAN_MEMORY.)"""
    item = torch.empty((), dtype=dtype).element_size()
    per_site = item * (4 * N * D + 6 * L * N * K_out)
    return max(1, min(S, MEMORY_BUDGET // max(per_site, 1)))


def fit_probes(
    X,
    y,
    task: str = "classification",
    *,
    split: str | Split | Sequence[Split] = "holdout",
    k: int = 5,
    seed: int = 0,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    C_grid: Sequence[float] | None = None,
    alpha_grid: Sequence[float] | None = None,
    control: str | None = "shuffle",
    groups=None,
    site_names: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    solver: str = "auto",
    tol: float | None = None,
    select_tol: float | None = None,
    max_iter: int | None = None,
    site_chunk: int | None = None,
) -> ProbeFit:
    """Fit one linear probe per site and score it on held-out rows.

    X: [S, N, D] activations (S sites, N examples, D features; torch or numpy, any float dtype;
       [N, D] is one site). y: [N] labels shared by all sites (any hashable values for
       classification, numbers for regression).
    task: "classification" (L2 logistic regression; binary or multinomial from the number of
       classes) or "regression" (ridge).
    split: "holdout" (one stratified train/val/test split: val_fraction, test_fraction), "kfold"
       (k stratified folds: each is the test fold once, the next fold its validation fold), or
       your own Split / list of Splits.
    C_grid / alpha_grid: regularisation values tried (chosen per site on validation rows).
    control: "shuffle" (permuted labels), "groups" (one random label per value of `groups`,
       Hewitt & Liang's type-level control) or None.
    device: where to fit (default: X's device); dtype: the fitting precision (float64 default).
    solver: "auto" | "newton" | "lbfgs"; tol: relative gradient tolerance of the reported probes
       (default 1e-8 in float64, 1e-5 in lower precision); select_tol: tolerance of the grid fits
       used only to choose C (default max(tol, 1e-5): the chosen fit is then refined to tol);
       site_chunk: sites fitted together (default: by memory).
    Returns a ProbeFit (see result.py): held-out metrics per fold and site, training-set and
    control metrics, selectivity, chosen C / alpha, directions and standardisation statistics.
    """
    X = _as_features(X)
    S, N, D = X.shape
    if not bool(torch.isfinite(X).all()):
        raise DataError(
            "activations contain NaN or infinite values",
            remedy="check the collection (overflow in half precision?)",
        )
    y_enc, classes = _encode_labels(y, task)
    if y_enc.shape[0] != N:
        raise DataError(f"{N} examples of features but {y_enc.shape[0]} labels")
    K = len(classes) if classes is not None else None
    if task == "classification":
        grid = sorted(float(c) for c in (C_grid if C_grid is not None else DEFAULT_C_GRID))
        grid_name = "C"
    else:
        grid = sorted((float(a) for a in (alpha_grid if alpha_grid is not None else DEFAULT_ALPHA_GRID)), reverse=True)
        grid_name = "alpha"
    if not grid or any(not (g > 0 and math.isfinite(g)) for g in grid):
        raise ConfigError(f"{grid_name} grid must be non-empty positive finite numbers, got {grid}")
    if site_names is None:
        site_names = [str(i) for i in range(S)]
    site_names = list(site_names)
    if len(site_names) != S:
        raise ConfigError(f"{len(site_names)} site names for {S} sites")

    kind, splits = _make_splits(
        split, y_enc, k=k, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction,
        stratify=task == "classification",
    )
    for f, sp in enumerate(splits):
        _check_split(sp, N, y_enc, K, len(grid) > 1, f)

    label_sets = [y_enc]
    if control == "shuffle":
        label_sets.append(shuffled_labels(y_enc, seed=seed))
    elif control == "groups":
        if groups is None:
            raise ConfigError("control='groups' needs groups=[one key per example]")
        label_sets.append(group_labels(y_enc, groups, seed=seed))
    elif control is not None:
        raise ConfigError(f"control must be 'shuffle', 'groups' or None, got {control!r}")
    Y = torch.stack(label_sets)  # [L, N]
    L = Y.shape[0]

    dev = torch.device(device) if device is not None else X.device
    K_out = 1 if (K is None or K == 2) else K
    chunk = site_chunk or _chunk_size(S, N, D, L, K_out, dtype)
    if tol is None:
        tol = 1e-8 if dtype == torch.float64 else 1e-5
    if select_tol is None:
        select_tol = max(tol, 1e-5)
    solve_kw = {"solver": solver, "tol": tol, "select_tol": select_tol, "max_iter": max_iter}

    per_fold = []
    for sp in splits:
        parts = []
        for s0 in range(0, S, chunk):
            Xc = X[s0 : s0 + chunk].to(device=dev, dtype=dtype)
            parts.append(_fit_one_split(Xc, Y, sp, task, K, grid, solve_kw))
        per_fold.append(_cat_sites(parts))

    def stack(key, l=None):
        vals = [r[key] if l is None else r[key][l] for r in per_fold]
        return torch.stack([v.detach().cpu() for v in vals])

    def stack_metrics(scope, l):
        if per_fold[0][scope] is None:
            return {}
        return {m: torch.stack([r[scope][m][l].cpu() for r in per_fold]) for m in per_fold[0][scope]}

    chance = None
    if task == "classification":
        chance = torch.tensor([
            float((y_enc[sp.test.cpu()] == torch.bincount(y_enc[sp.train.cpu()], minlength=K).argmax()).double().mean())
            for sp in splits
        ])
    has_control = L > 1
    converged = stack("converged", 0)
    if not bool(converged.all()):
        bad = [site_names[i] for i in torch.nonzero(~converged.all(0)).flatten().tolist()]
        warnings.warn(
            f"probe fit did not reach its gradient tolerance at sites {bad[:10]}"
            f"{' ...' if len(bad) > 10 else ''} (see ProbeFit.converged); raise max_iter or use "
            "solver='newton', or check for constant or duplicated features",
            RuntimeWarning,
            stacklevel=2,
        )
    return ProbeFit(
        task=task,
        site_names=site_names,
        classes=classes,
        split=kind,
        seed=seed,
        grid_name=grid_name,
        grid=grid,
        test=stack_metrics("test", 0),
        val=stack_metrics("val", 0),
        train=stack_metrics("train", 0),
        control_test=stack_metrics("test", 1) if has_control else None,
        control_train=stack_metrics("train", 1) if has_control else None,
        control=control,
        chosen=stack("chosen", 0),
        control_chosen=stack("chosen", 1) if has_control else None,
        coef=stack("coef", 0),
        intercept=stack("intercept", 0),
        mean=stack("mean"),
        std=stack("std"),
        converged=converged,
        chance_accuracy=chance,
        splits=[sp.to("cpu") for sp in splits],
        control_coef=stack("coef", 1) if has_control else None,
        control_intercept=stack("intercept", 1) if has_control else None,
        control_labels=Y[1].cpu() if has_control else None,
    )


def _cat_sites(parts: list[dict]) -> dict:
    """Concatenate per-chunk results along the site axis (dim 1 for [L, S, ...], 0 for [S, ...])."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key, v in parts[0].items():
        if v is None:
            out[key] = None
        elif isinstance(v, dict):
            out[key] = {m: torch.cat([p[key][m] for p in parts], 1) for m in v}
        elif key in ("mean", "std"):
            out[key] = torch.cat([p[key] for p in parts], 0)
        else:
            out[key] = torch.cat([p[key] for p in parts], 1)
    return out
