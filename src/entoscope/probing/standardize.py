"""Per-site, per-feature standardisation with statistics taken from the training rows only.

z = (x - mean) / std, where mean and std (population std, ddof=0, as scikit-learn's
StandardScaler) come from the training rows of each site. A feature that is constant on the
training rows gets std = 1 (it is centred, not blown up). The statistics are kept so that a weight
vector w learnt on z maps back to the raw activation basis: w . z + b = (w / std) . x + (b - (w / std) . mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Standardizer:
    mean: torch.Tensor  # [S, D]
    std: torch.Tensor  # [S, D]

    @classmethod
    def fit(cls, X: torch.Tensor, rows: torch.Tensor | None = None) -> "Standardizer":
        """Statistics of X[:, rows] (X: [S, N, D])."""
        Xt = X if rows is None else X.index_select(1, rows)
        mean = Xt.mean(dim=1)
        std = Xt.std(dim=1, correction=0)
        # Constant on the training rows (relative to the feature's scale): leave unscaled.
        tiny = torch.finfo(std.dtype).eps * 10 * mean.abs().clamp_min(1.0)
        std = torch.where(std > tiny, std, torch.ones_like(std))
        return cls(mean, std)

    def transform(self, X: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        Xt = X if rows is None else X.index_select(1, rows)
        return (Xt - self.mean[:, None, :]) / self.std[:, None, :]

    def raw_coef(self, coef: torch.Tensor) -> torch.Tensor:
        """Weights on standardised features [S, K, D] -> the same linear map on raw features."""
        return coef / self.std[:, None, :]

    def raw_intercept(self, coef: torch.Tensor, intercept: torch.Tensor) -> torch.Tensor:
        """Intercepts [S, K] -> intercepts for the raw-feature weights of `raw_coef`."""
        return intercept - torch.einsum("skd,sd->sk", self.raw_coef(coef), self.mean)
