"""Seeded, deterministic row splits: train/validation/test holdout and k-fold cross-validation.

Everything here returns int64 index tensors (sorted) into the example axis. The same `y` and
`seed` always give the same split, on any machine: the permutations come from a CPU
`torch.Generator`, never from the global RNG.

Stratification (classification): every class is split in the same proportions, so a rare class
cannot vanish from the training rows by chance. Regression labels are split without strata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError, DataError


@dataclass(frozen=True)
class Split:
    """Row indices of one train/validation/test partition (disjoint, together covering all rows)."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor

    def to(self, device: torch.device | str) -> "Split":
        return Split(self.train.to(device), self.val.to(device), self.test.to(device))

    @property
    def n(self) -> int:
        return int(self.train.numel() + self.val.numel() + self.test.numel())


def _codes(y, stratify: bool) -> np.ndarray:
    """One integer stratum per row (all zeros when not stratifying)."""
    y = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y)
    if y.ndim != 1:
        raise DataError(f"labels must be one-dimensional, got shape {y.shape}")
    if not stratify:
        return np.zeros(len(y), dtype=np.int64)
    _, codes = np.unique(y, return_inverse=True)
    return codes.reshape(-1).astype(np.int64)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def _class_deal(codes: np.ndarray, seed: int) -> torch.Tensor:
    """All rows, shuffled within each stratum and concatenated stratum after stratum.

    Dealing this order round-robin (position j -> bucket j % k) gives every bucket each stratum's
    rows in equal shares (within one), and bucket sizes within one of each other.
    """
    g = _generator(seed)
    codes_t = torch.from_numpy(codes)
    parts = []
    for c in range(int(codes.max()) + 1 if len(codes) else 0):
        idx = torch.nonzero(codes_t == c).flatten()
        parts.append(idx[torch.randperm(idx.numel(), generator=g)])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def holdout_split(
    y,
    *,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    seed: int = 0,
    stratify: bool = True,
) -> Split:
    """One seeded train/validation/test split.

    Per stratum of n rows: round(n * test_fraction) test rows, round(n * val_fraction) validation
    rows, the rest training rows (at least one training row per stratum is kept).
    """
    if not (0 <= val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ConfigError(
            f"val_fraction={val_fraction}, test_fraction={test_fraction} do not leave training rows",
            remedy="use fractions in [0, 1) whose sum is below 1 (e.g. 0.2 and 0.2)",
        )
    codes = _codes(y, stratify)
    g = _generator(seed)
    codes_t = torch.from_numpy(codes)
    train, val, test = [], [], []
    for c in range(int(codes.max()) + 1 if len(codes) else 0):
        idx = torch.nonzero(codes_t == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n = idx.numel()
        n_test = int(np.floor(n * test_fraction + 0.5))
        n_val = int(np.floor(n * val_fraction + 0.5))
        while n_test + n_val >= n and n_test + n_val > 0:  # keep one training row
            if n_val >= n_test and n_val > 0:
                n_val -= 1
            else:
                n_test -= 1
        test.append(idx[:n_test])
        val.append(idx[n_test : n_test + n_val])
        train.append(idx[n_test + n_val :])
    cat = lambda parts: torch.sort(torch.cat(parts))[0] if parts else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return Split(cat(train), cat(val), cat(test))


def kfold_indices(y, k: int = 5, *, seed: int = 0, stratify: bool = True) -> list[torch.Tensor]:
    """k disjoint folds covering all rows (stratified: each class spread evenly over the folds)."""
    n = len(y)
    if not (2 <= k <= n):
        raise ConfigError(f"k={k} folds for {n} rows", remedy="use 2 <= k <= number of examples")
    order = _class_deal(_codes(y, stratify), seed)
    bucket = torch.arange(n) % k
    return [torch.sort(order[bucket == f])[0] for f in range(k)]


def kfold_splits(y, k: int = 5, *, seed: int = 0, stratify: bool = True) -> list[Split]:
    """k train/validation/test splits for cross-validation.

    Fold f is the test set of split f; fold (f + 1) % k is its validation set (used only to choose
    the regularisation strength); the other k - 2 folds are its training rows. Every row is a test
    row exactly once and a validation row exactly once. Needs k >= 3.
    """
    if k < 3:
        raise ConfigError(
            f"k={k}: cross-validation with a validation fold needs k >= 3",
            remedy="use k >= 3 (5 is usual), or split='holdout'",
        )
    folds = kfold_indices(y, k, seed=seed, stratify=stratify)
    out = []
    for f in range(k):
        v = (f + 1) % k
        train = torch.sort(torch.cat([folds[j] for j in range(k) if j not in (f, v)]))[0]
        out.append(Split(train, folds[v], folds[f]))
    return out
