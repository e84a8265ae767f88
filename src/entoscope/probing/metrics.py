"""Held-out metrics, batched over any leading dims (sites, label sets, folds), in torch.

Conventions (each checked against sklearn.metrics in tests/test_probing_core.py):
  accuracy(y, yhat)        fraction of rows with yhat == y
  f1_macro(y, yhat, K)     unweighted mean over the classes present in y or yhat of
                           2 tp / (2 tp + fp + fn)  (= sklearn f1_score(average="macro"))
  auroc(t, score)          binary, exact Mann-Whitney U / (n_pos n_neg), tied scores count 1/2
                           (= roc_auc_score); NaN when t has a single class
  auroc_ovr(y, prob)       one-vs-rest macro mean of auroc over the classes that have both
                           positives and negatives in y (= roc_auc_score(multi_class="ovr",
                           average="macro") when every class is present; sklearn refuses otherwise)
  r2(y, yhat)              1 - SS_res / SS_tot (SS_tot about the mean of y); NaN when y is constant
  mse(y, yhat)             mean squared error
Labels are integer class codes; the last dim of every input is the row axis (for `auroc_ovr`, the
one before the class axis). Labels broadcast against predictions: [N] against [S, N] is fine.
"""

from __future__ import annotations

import torch


def _float(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.float64


def accuracy(y: torch.Tensor, yhat: torch.Tensor) -> torch.Tensor:
    return (y == yhat).to(torch.float64).mean(-1)


def f1_macro(y: torch.Tensor, yhat: torch.Tensor, n_classes: int) -> torch.Tensor:
    y, yhat = torch.broadcast_tensors(y, yhat)
    Y = torch.nn.functional.one_hot(y.long(), n_classes).to(torch.float64)
    P = torch.nn.functional.one_hot(yhat.long(), n_classes).to(torch.float64)
    tp = (Y * P).sum(-2)
    fp = ((1 - Y) * P).sum(-2)
    fn = (Y * (1 - P)).sum(-2)
    denom = 2 * tp + fp + fn  # zero exactly when the class is in neither y nor yhat
    present = denom > 0
    f1 = torch.where(present, 2 * tp / denom.clamp_min(1), torch.zeros_like(tp))
    return f1.sum(-1) / present.sum(-1).clamp_min(1)


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last dim, tied values sharing the mean of their ranks."""
    xs = x.sort(-1).values.contiguous()
    x = x.contiguous()
    below = torch.searchsorted(xs, x, right=False)
    upto = torch.searchsorted(xs, x, right=True)
    return (below + upto + 1).to(torch.float64) / 2


def auroc(t: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    t, score = torch.broadcast_tensors(t, score)
    pos = t.to(torch.bool)
    n_pos = pos.sum(-1).to(torch.float64)
    n_neg = (~pos).sum(-1).to(torch.float64)
    rank_sum = (_average_ranks(score) * pos).sum(-1)
    u = rank_sum - n_pos * (n_pos + 1) / 2
    ok = (n_pos > 0) & (n_neg > 0)
    return torch.where(ok, u / (n_pos * n_neg).clamp_min(1), torch.full_like(u, float("nan")))


def auroc_ovr(y: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    K = prob.shape[-1]
    per_class = torch.stack([auroc(y == k, prob[..., k]) for k in range(K)], -1)
    defined = ~torch.isnan(per_class)
    total = torch.where(defined, per_class, torch.zeros_like(per_class)).sum(-1)
    count = defined.sum(-1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))


def mse(y: torch.Tensor, yhat: torch.Tensor) -> torch.Tensor:
    dt = _float(yhat)
    return ((y.to(dt) - yhat) ** 2).mean(-1)


def r2(y: torch.Tensor, yhat: torch.Tensor) -> torch.Tensor:
    dt = _float(yhat)
    y, yhat = torch.broadcast_tensors(y.to(dt), yhat)
    ss_res = ((y - yhat) ** 2).sum(-1)
    ss_tot = ((y - y.mean(-1, keepdim=True)) ** 2).sum(-1)
    ok = ss_tot > 0
    return torch.where(ok, 1 - ss_res / torch.where(ok, ss_tot, 1), torch.full_like(ss_res, float("nan")))


def classification_scores(y: torch.Tensor, logits: torch.Tensor, n_classes: int) -> dict[str, torch.Tensor]:
    """accuracy, f1_macro, auroc from decision values: [..., N] (binary) or [..., N, K]."""
    if n_classes == 2:
        yhat = (logits > 0).long()
        auc = auroc(y, logits)
    else:
        yhat = logits.argmax(-1)
        auc = auroc_ovr(y, torch.softmax(logits, -1))
    return {"accuracy": accuracy(y, yhat), "f1_macro": f1_macro(y, yhat, n_classes), "auroc": auc}


def regression_scores(y: torch.Tensor, yhat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"r2": r2(y, yhat), "mse": mse(y, yhat)}
