"""The lens result's takeaway: when the answer appears through the lens, with intervals, at the position
nearest each prompt's end (END: each prompt's own last token; a token index is called the last token
only when every prompt has that length)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from ..stats import value_with_ci


def _end_offset(label: Any) -> int | None:
    """k for a label END-k (0 for END), None for anything else."""
    m = re.fullmatch(r"END(?:-(\d+))?", str(label))
    return None if m is None else int(m.group(1) or 0)


def _is_index(label: Any) -> bool:
    return isinstance(label, (int, np.integer)) or str(label).isdigit()


def last_position_rows(table: pd.DataFrame, lengths: tuple[int, int] | None = None) -> tuple[pd.DataFrame, str]:
    """The rows of the position nearest each prompt's end that the table has, and how to name it.

    END (each prompt's last token) first, then END-k with the smallest k; else the largest token index,
    called the last token only when every prompt has that many tokens (lengths = (shortest, longest));
    else the last role asked for."""
    if "position" not in table or table["position"].isna().all():
        return table, ""
    labels = list(dict.fromkeys(table["position"]))
    from_end = [(k, p) for p in labels if (k := _end_offset(p)) is not None]
    indices = [p for p in labels if _is_index(p)]
    if from_end:
        k, last = min(from_end, key=lambda kp: kp[0])
        where = "At each prompt's last token (END)" if k == 0 else \
            f"At {last} ({k} token{'s' if k > 1 else ''} before each prompt's last)"
    elif indices:
        last = max(indices, key=int)
        p = int(last)
        if lengths is not None and lengths[0] == lengths[1] == p + 1:
            where = f"At the last token (position {p}: every prompt has {p + 1} tokens)"
        elif lengths is not None and lengths[0] != lengths[1]:
            where = (f"At token position {p} (prompts have {lengths[0]}..{lengths[1]} tokens, so not each prompt's "
                     "last; END counts from each prompt's end)")
        else:
            where = f"At token position {p}"
    else:
        last = labels[-1]
        where = f"At {last}"
    return table[table["position"] == last], where


def lens_takeaway(result: Any) -> str:
    t = result.table
    if not len(t) or "layer" not in t:
        return ""
    rows, where = last_position_rows(t, result.extra.get("prompt_lengths"))
    if not where:
        where = "Over the prompts"
    rows = rows.sort_values("layer")
    first, final = rows.iloc[0], rows.iloc[-1]
    n = int(first["n_prompts"]) if "n_prompts" in first else 0
    level = f"{round(100 * float(first['ci_level']))}%" if "ci_level" in first else "95%"
    if "target_prob_mean" in rows:
        top = rows[rows["target_top1"] >= 0.5] if "target_top1" in rows else rows.iloc[:0]
        when = (f"the answer is the lens's top token for most prompts from layer {int(top['layer'].iloc[0])} on"
                if len(top) else "the answer is never the lens's top token for most prompts")
        return (f"{where} {when}; the answer's mean probability through the lens is "
                f"{value_with_ci(first, 'target_prob_mean', '.3g')} at layer {int(first['layer'])} and "
                f"{value_with_ci(final, 'target_prob_mean', '.3g')} at layer {int(final['layer'])} "
                f"({level} intervals over {n} prompts).")
    if "kl_mean" in rows:
        return (f"{where} KL(final || lens) falls from {value_with_ci(first, 'kl_mean', '.3g')} nats at layer "
                f"{int(first['layer'])} to {value_with_ci(final, 'kl_mean', '.3g')} at layer {int(final['layer'])} "
                f"({level} intervals over {n} prompts).")
    return ""
