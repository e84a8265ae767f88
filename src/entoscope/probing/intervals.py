"""Intervals over prompts for the held-out probe scores: a bootstrap of the held-out predictions.

The per-prompt source is every held-out prediction: each prompt is a test row of one fold (k-fold:
every prompt once; holdout: the test rows only), with its fold, its label (and control label), and
the probe's (and the control probe's) decision values at every site. All folds' held-out rows are
pooled into one table of R rows and resampled together (prompts drawn with replacement, R per
resample). The resampled statistic is the table's own number: the mean over folds of each fold's
metric on its (resampled) test rows, so at weight 1 it equals `test_<metric>` exactly. A fold whose
resampled rows leave a metric undefined (AUROC with one class, R^2 with a constant target) is left
out of that resample's mean.

The weighted metrics are the ones of `metrics.py` with row weights w (counts of each row in the
resample): accuracy sum w [yhat = y] / sum w; macro F1 from weighted tp / fp / fn per class; AUROC
the weighted Mann-Whitney statistic (sum over positive i, negative j of w_i w_j ([s_i > s_j] + 1/2
[s_i = s_j]) / (W_pos W_neg)), one-vs-rest for several classes; R^2 = 1 - sum w (y - yhat)^2 / sum w
(y - ybar_w)^2; MSE. Columns: `test_<metric>_ci_low/high` (and `_se`), with a control
`control_test_<primary>_ci_low/high` and `selectivity_ci_low/high` (the primary metric minus the
control probe's, on the same resample), one `ci_level`.

What this interval covers: another sample of test prompts for these fitted probes. The variation of
the probe across training sets is the fold spread (`_std`), which it does not include.

Accuracy is a share of held-out prompts, so its interval (and the control probe's) is Wilson's over the R
pooled held-out predictions (k correct of R; stats/proportion.py) instead of the bootstrap's: a probe right on
all 64 held-out prompts would get the bootstrap interval [1.00, 1.00] (every resample is also all right),
while Wilson's is [0.94, 1.00], what 64 prompts can say. Its `_se` stays the bootstrap's; F1, AUROC, R^2,
MSE and selectivity keep the bootstrap interval. `stats.n_boot: 0` asks for no intervals, and gets none.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..stats import FunctionStat, Stats, interval_columns, summarise
from ..stats.proportion import wilson_interval
from .predict import decision_values
from .result import ProbeFit


@dataclass
class HeldOut:
    """The pooled held-out rows of one fit: R rows (fold, example), S sites."""

    fold: np.ndarray  # [R] which fold's test row
    example: np.ndarray  # [R]
    y: np.ndarray  # [R] class codes (int) or targets (float)
    values: np.ndarray  # [S, R, K'] decision values of the probe
    y_control: np.ndarray | None  # [R] the control task's labels
    control_values: np.ndarray | None  # [S, R, K'] the control probe's decision values
    site_names: list[str]
    n_classes: int | None  # None: regression


def held_out_values(fit: ProbeFit, X: torch.Tensor, codes: torch.Tensor) -> HeldOut:
    """Every fold's probe (and control probe) applied to its own test rows of X [S, N, D]."""
    dv = decision_values(fit, X).cpu().double()
    dvc = decision_values(fit, X, control=True).cpu().double() if fit.control_coef is not None else None
    folds, rows, vals, cvals = [], [], [], []
    for f, sp in enumerate(fit.splits):
        te = sp.test.cpu()
        folds.append(np.full(te.numel(), f))
        rows.append(te.numpy())
        vals.append(dv[f][:, te])
        if dvc is not None:
            cvals.append(dvc[f][:, te])
    example = np.concatenate(rows)
    y_control = None if fit.control_labels is None else fit.control_labels.cpu().numpy()[example]
    return HeldOut(np.concatenate(folds), example, codes.cpu().numpy()[example], torch.cat(vals, 1).numpy(),
                   y_control, None if dvc is None else torch.cat(cvals, 1).numpy(), list(fit.site_names),
                   None if fit.classes is None else len(fit.classes))


def metric_names(n_classes: int | None) -> list[str]:
    return ["r2", "mse"] if n_classes is None else ["accuracy", "f1_macro", "auroc"]


# ---------------------------------------------------------------------- weighted metrics: w [B, n]
def _auroc(w: np.ndarray, positive: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[B, S] weighted Mann-Whitney AUROC of scores [S, n] against labels positive [n] (ties count 1/2);
    NaN where a resample has one class."""
    B, (S, n) = w.shape[0], score.shape
    order = np.argsort(score, axis=1, kind="stable")  # [S, n]
    s = np.take_along_axis(score, order, 1)
    pos = np.flatnonzero(positive)
    # per site, each positive row's rank range among tied scores: negatives below count 1, tied 1/2
    lo = np.stack([np.searchsorted(s[i], score[i, pos], "left") for i in range(S)])  # [S, P]
    hi = np.stack([np.searchsorted(s[i], score[i, pos], "right") for i in range(S)])
    cum = np.zeros((B, S, n + 1))
    np.cumsum((w * ~positive)[:, order], 2, out=cum[:, :, 1:])  # negative weight up to each rank
    flat = cum.reshape(B, S * (n + 1))
    base = (np.arange(S) * (n + 1))[:, None]
    below = flat[:, (base + lo).ravel()] + flat[:, (base + hi).ravel()]  # [B, S*P], twice the count
    num = 0.5 * np.einsum("bsp,bp->bs", below.reshape(B, S, len(pos)), w[:, pos])
    w_pos = w[:, pos].sum(1)
    w_neg = w.sum(1) - w_pos
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = ((w_pos > 0) & (w_neg > 0))[:, None]
        return np.where(ok, num / (w_pos * w_neg)[:, None], np.nan)


def _classification(w: np.ndarray, y: np.ndarray, values: np.ndarray, K: int) -> dict[str, np.ndarray]:
    """accuracy, f1_macro, auroc [B, S] from decision values [S, n, K'] (binary: the logit)."""
    S = values.shape[0]
    if K == 2:
        yhat = (values[..., 0] > 0).astype(int)  # [S, n]
        probs = None
    else:
        yhat = values.argmax(-1)
        e = np.exp(values - values.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
    total = w.sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = (w @ (yhat == y).T.astype(float)) / total
    Y = np.eye(K)[y]  # [n, K]
    P = np.eye(K)[yhat]  # [S, n, K]
    n = len(y)

    def flat(a: np.ndarray) -> np.ndarray:  # [S, n, K] -> [n, S*K]
        return np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(n, S * K)
    tp = (w @ flat(Y[None] * P)).reshape(-1, S, K)
    predicted = (w @ flat(P)).reshape(-1, S, K)  # tp + fp
    actual = (w @ Y)[:, None, :]  # tp + fn
    denom = predicted + actual  # 2 tp + fp + fn
    present = denom > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(present, 2 * tp / np.where(present, denom, 1), 0.0).sum(-1) / np.maximum(present.sum(-1), 1)
    if K == 2:
        auroc = _auroc(w, y == 1, values[..., 0])
    else:
        assert probs is not None
        per_class = np.stack([_auroc(w, y == k, probs[..., k]) for k in range(K)], -1)  # [B, S, K]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample where no class is defined stays NaN
            auroc = np.nanmean(per_class, -1)
    return {"accuracy": accuracy, "f1_macro": f1, "auroc": auroc}


def _regression(w: np.ndarray, y: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray]:
    """r2, mse [B, S] from predictions [S, n, 1]."""
    err2 = (y[None, :] - values[..., 0]) ** 2  # [S, n]
    total = w.sum(1, keepdims=True)
    ss_res = w @ err2.T
    sy, syy = w @ y, w @ y**2
    with np.errstate(invalid="ignore", divide="ignore"):
        ss_tot = (syy - sy**2 / total[:, 0])[:, None]
        ok = ss_tot > 1e-12 * np.maximum(syy[:, None], 1e-300)
        r2 = np.where(ok, 1 - ss_res / np.where(ok, ss_tot, 1), np.nan)
        return {"r2": r2, "mse": ss_res / total}


def _fold_mean(W: np.ndarray, h: HeldOut, y: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray]:
    """metric -> [B, S]: the mean over folds of each fold's weighted metric (undefined folds left out)."""
    per_fold: dict[str, list[np.ndarray]] = {}
    for f in np.unique(h.fold):
        rows = h.fold == f
        w = W[:, rows]
        m = _regression(w, y[rows].astype(float), values[:, rows]) if h.n_classes is None else \
            _classification(w, y[rows].astype(int), values[:, rows], h.n_classes)
        for k, v in m.items():
            per_fold.setdefault(k, []).append(np.where(w.sum(1, keepdims=True) > 0, v, np.nan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample with no defined fold stays NaN
        return {k: np.nanmean(np.stack(v), 0) for k, v in per_fold.items()}


def blocks_of(h: HeldOut) -> list[str]:
    """The summarised columns, in the statistic's cell order (each block one cell per site)."""
    names = metric_names(h.n_classes)
    blocks = [f"test_{k}" for k in names]
    if h.control_values is not None:
        blocks += [f"control_test_{names[0]}", "selectivity"]
    return blocks


def probing_stat(h: HeldOut) -> FunctionStat:
    """The weighted statistic over the R pooled held-out rows: [K, R] weights -> [K, blocks x sites]."""
    names = metric_names(h.n_classes)
    S, R = h.values.shape[0], h.values.shape[1]

    def stat(W: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        m = _fold_mean(W, h, h.y, h.values)
        out = [m[k] for k in names]
        if h.control_values is not None:
            assert h.y_control is not None
            control = _fold_mean(W, h, h.y_control, h.control_values)[names[0]]
            out += [control, m[names[0]] - control]
        return np.concatenate(out, 1)[:, cols]

    return FunctionStat(stat, R, S * len(blocks_of(h)))


def summarise_probing(h: HeldOut, stats: Stats, seed: int) -> pd.DataFrame:
    """One row per site: `test_<metric>_ci_low/high/se`, and with a control `control_test_<primary>_*`
    and `selectivity_*`, bootstrapping the pooled held-out rows (see the module docstring)."""
    S = h.values.shape[0]
    summary = summarise(probing_stat(h), stats, seed)
    frame = pd.DataFrame({"site": h.site_names})
    for j, key in enumerate(blocks_of(h)):
        part = slice(j * S, (j + 1) * S)
        for col, v in interval_columns(summary, key, stats).items():
            frame[col] = v[part]
    if h.n_classes is not None and stats.n_boot > 0:  # accuracy: a share, Wilson's (module docstring); n_boot 0: none
        for key, y, values in (("test_accuracy", h.y, h.values), ("control_test_accuracy", h.y_control,
                                                                 h.control_values)):
            if f"{key}_ci_low" in frame and values is not None:
                frame[f"{key}_ci_low"], frame[f"{key}_ci_high"] = wilson_interval(
                    correct(y, values, h.n_classes), values.shape[1], stats.ci_level)
    frame["n_held_out"] = h.values.shape[1]
    frame["ci_level"] = stats.ci_level
    return frame


def correct(y: np.ndarray, values: np.ndarray, n_classes: int) -> np.ndarray:
    """[S] how many of the R held-out rows each site's probe classifies right (decision values [S, R, K'])."""
    yhat = (values[..., 0] > 0).astype(int) if n_classes == 2 else values.argmax(-1)
    return (yhat == np.asarray(y)[None, :]).sum(1)
