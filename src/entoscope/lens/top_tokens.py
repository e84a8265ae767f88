"""Per-prompt top-1 tokens beside the mean distribution's: what the lens's top token is prompt by prompt.

The lens table's `top1_token` is the top token of the mean lens distribution over prompts (descriptive). A
token that is second everywhere can top the mean while topping no prompt: on SmolLM2's IOI prompts the mean
distribution's top token at layer 29 is " the", while the answer (a different name in each prompt) is the top
token of 81% of them. So each site also gets, from the prompts' own top-1 tokens:

    top1_token_share   the share of prompts whose own lens top-1 token is `top1_token`
    modal_token   the token that is the lens's top-1 in the most prompts (ties: the smallest id)
    modal_share   the share of prompts where it is

each share with its Wilson interval over prompts (stats/proportion.py: a share of prompts, whose bootstrap
interval would collapse at 0 and 1). With answers, `target_top1` (the share whose top-1 is each prompt's own
answer) is the one to read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from ..stats import wilson_interval

BLOCK = 4096  # prompts read at once


def top1_shares(table: pd.DataFrame, n: int, read_ids: Callable[[int, int], np.ndarray], mean_top: np.ndarray,
                decode: Callable[[int], str], level: float) -> pd.DataFrame:
    """`table` with the columns of the module docstring after `top1_prob`; read_ids(lo, hi) -> [rows, sites]
    each prompt's lens top-1 token id per site, mean_top [sites] the mean distribution's top-1 ids."""
    U = len(mean_top)
    same = np.zeros(U, dtype=np.int64)
    counts: list[dict[int, int]] = [{} for _ in range(U)]
    for lo in range(0, n, BLOCK):
        ids = np.asarray(read_ids(lo, min(n, lo + BLOCK)), dtype=np.int64)
        same += (ids == np.asarray(mean_top)[None, :]).sum(0)
        for u in range(U):
            values, k = np.unique(ids[:, u], return_counts=True)
            for v, c in zip(values.tolist(), k.tolist()):
                counts[u][v] = counts[u].get(v, 0) + c
    modal = [min(c.items(), key=lambda kv: (-kv[1], kv[0])) if c else (-1, 0) for c in counts]
    modal_k = np.array([k for _, k in modal], dtype=np.int64)
    new: dict[str, object] = {}
    for name, k in (("top1_token_share", same), ("modal_share", modal_k)):
        low, high = wilson_interval(k, n, level)
        new[name] = k / n if n else np.full(U, np.nan)
        new[f"{name}_ci_low"], new[f"{name}_ci_high"] = low, high
        if name == "top1_token_share":
            new["modal_token"] = [decode(t) if t >= 0 else "" for t, _ in modal]
    out = table.copy()
    at = list(out.columns).index("top1_prob") + 1 if "top1_prob" in out else len(out.columns)
    order = ["top1_token_share", "top1_token_share_ci_low", "top1_token_share_ci_high", "modal_token",
             "modal_share", "modal_share_ci_low", "modal_share_ci_high"]
    for i, name in enumerate(order):
        out.insert(at + i, name, new[name])
    return out
