"""A fitted ProbeFit applied to activations: decision values, held-out scores, per-prompt predictions.

Each fold's probe is applied through its raw-space map (`raw_coef`, `raw_intercept`: the
standardisation folded in), so the features are raw activations as collected.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from . import metrics as M
from .result import ProbeFit


def label_codes(fit: ProbeFit, y) -> Tensor:
    """[N] class codes (index in fit.classes) for classification, float64 targets for regression."""
    y_np = np.asarray(y)
    if fit.classes is None:
        return torch.from_numpy(y_np.astype(np.float64))
    index = {c: i for i, c in enumerate(fit.classes)}
    return torch.tensor([index[v] for v in y_np.tolist()], dtype=torch.long)


def decision_values(fit: ProbeFit, X: Tensor, sites: list[int] | None = None, control: bool = False) -> Tensor:
    """[F, S, N, K'] = X [S, N, D] through each fold's raw map (binary/regression: K' = 1); with
    control=True, through the control probe's."""
    W, b = fit.raw_map(control)
    if sites is not None:
        W, b = W[:, sites], b[:, sites]
    return torch.einsum("snd,fskd->fsnk", X.to(W.device, W.dtype), W) + b[:, :, None, :]


def _scores(fit: ProbeFit, codes: Tensor, values: Tensor) -> dict[str, Tensor]:
    """Metrics of decision values [S, n, K'] against labels [n]."""
    if fit.classes is None:
        return M.regression_scores(codes.to(values.device), values[..., 0])
    K = len(fit.classes)
    return M.classification_scores(codes.to(values.device), values[..., 0] if K == 2 else values, K)


def held_out_scores(fit: ProbeFit, X: Tensor, codes: Tensor, sites: list[int] | None = None) -> dict[str, Tensor]:
    """Each fold's probe scored on its own test rows of X [S, N, D]: metric -> [F, S].
    `sites`: which of the fit's sites X holds (default: all, in order)."""
    dv = decision_values(fit, X, sites)
    per_fold = [_scores(fit, codes[sp.test], dv[f][:, sp.test.to(dv.device)]) for f, sp in enumerate(fit.splits)]
    return {m: torch.stack([p[m] for p in per_fold]).cpu() for m in per_fold[0]}


def held_out_predictions(fit: ProbeFit, X: Tensor, codes: Tensor, labels, site_labels: list[str]) -> pd.DataFrame:
    """One row per (site, test row of each fold): the label, the prediction and its score.

    score: binary, the logit of the positive class (fit.classes[1]); multi-class, the softmax
    probability of the predicted class; regression, the predicted value (= prediction).
    """
    dv = decision_values(fit, X).cpu()  # [F, S, N, K']
    labels = np.asarray(labels, dtype=object)
    frames = []
    S = dv.shape[1]
    for f, sp in enumerate(fit.splits):
        te = sp.test.cpu()
        v = dv[f][:, te]  # [S, n, K']
        if fit.classes is None:
            score = v[..., 0]
            pred = score.numpy()
        elif len(fit.classes) == 2:
            score = v[..., 0]
            pred = np.asarray(fit.classes, dtype=object)[(score > 0).long().numpy()]
        else:
            prob, idx = v.softmax(-1).max(-1)
            score = prob
            pred = np.asarray(fit.classes, dtype=object)[idx.numpy()]
        n = te.numel()
        frames.append(pd.DataFrame({
            "site": np.repeat(np.asarray(site_labels, dtype=object), n),
            "fold": f,
            "example": np.tile(te.numpy(), S),
            "label": np.tile(labels[te.numpy()], S),
            "prediction": np.asarray(pred).reshape(-1),
            "score": score.reshape(-1).double().numpy(),
        }))
    out = pd.concat(frames, ignore_index=True).infer_objects()  # labels of one type get a plain dtype
    if fit.classes is not None:
        out["correct"] = out["label"] == out["prediction"]
    return out
