"""Benjamini-Hochberg control of the false discovery rate (Benjamini & Hochberg 1995)."""

from __future__ import annotations

import numpy as np


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """Adjusted p-values (q-values) of the BH step-up procedure; NaN stays NaN and is not counted.

    A cell is a discovery at FDR level alpha when q <= alpha. q_(i) = min_{j >= i} p_(j) * m / j over the
    m finite p-values sorted ascending, capped at 1.
    """
    p = np.asarray(p, dtype=float)
    q = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    m = int(ok.sum())
    if m == 0:
        return q
    order = np.argsort(p[ok], kind="stable")
    ranked = p[ok][order] * m / np.arange(1, m + 1)
    ranked = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(ranked, 1.0)
    q[ok] = out
    return q
