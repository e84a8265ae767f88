"""The lens result's takeaway: when the answer appears through the lens, with intervals, at the position
nearest each prompt's end (END: each prompt's own last token; a token index is called the last token
only when every prompt has that length). Every number is a quoted cell, every qualifier a rule of
results/claims.py."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, most


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


def _modal(b: TakeawayBuilder, row: Any, words: str) -> None:
    """' ... is ' the' for 0.62 [0.30, 0.86] of prompts at layer 28.': the prompts' own top-1 token (the mean
    distribution's top token can top few of them: lens/top_tokens.py), a sentence of the details."""
    if "modal_share" not in row or not isinstance(row.get("modal_token"), str):
        return
    b.say(" " + words)
    b.quote(row, "modal_share", name=f"{row['modal_token']!r} for", after=f" of prompts at layer "
            f"{int(row['layer'])}")
    b.say(".")


def lens_takeaway(result: Any) -> Takeaway | str:
    t = result.table
    if not len(t) or "layer" not in t:
        return ""
    rows, where = last_position_rows(t, result.extra.get("prompt_lengths"))
    if not where:
        where = "Over the prompts"
    rows = rows.sort_values("layer")
    first, final = rows.iloc[0], rows.iloc[-1]
    b = TakeawayBuilder(key="site")
    modal: tuple[Any, str] | None = None  # the lens's commonest top token, said after the lead
    if "target_prob_mean" in rows:
        b.say(f"{where} ")
        if "target_top1" in rows:
            passes = [bool(most(r["target_top1"], r.get("target_top1_ci_low"))) for _, r in rows.iterrows()]
            start = next((i for i in range(len(passes)) if all(passes[i:])), None)
            if start is not None:
                b.say("the answer is the lens's top token for ")
                word = b.qualify(f"most prompts from layer {int(rows.iloc[start]['layer'])} on", "most")
                b.say(" (share of prompts: ")
                refs = []
                for j, (_, r) in enumerate(rows.iloc[start:].iterrows()):
                    b.say(", " if j else "")
                    refs.append(b.quote(r, "target_top1", name=False, after=f" at layer {int(r['layer'])}"))
                b.refer(word, refs)
                b.say(").")
                if start > 0:
                    modal = (rows.iloc[start - 1], "One layer earlier the lens's commonest top token is ")
            else:
                b.say("the answer is not the lens's top token for ")
                word = b.qualify("most prompts", "not_most")
                b.say(" at any layer (highest share: ")
                best = rows.loc[rows["target_top1"].astype(float).idxmax()]
                b.refer(word, [b.quote(best, "target_top1", name=False, after=f" at layer {int(best['layer'])}")])
                b.say(").")
                modal = (final, "The lens's commonest top token at the last layer is ")
            b.end_lead()
            b.say(" The answer's mean probability through the lens is ")
        else:
            b.say("the answer's mean probability through the lens is ")
        b.quote(first, "target_prob_mean", fmt=".3g", name=False, after=f" at layer {int(first['layer'])}")
        b.say(" and ")
        b.quote(final, "target_prob_mean", fmt=".3g", name=False, after=f" at layer {int(final['layer'])}")
    elif "kl_mean" in rows:
        b.say(f"{where} KL(final || lens) is ")
        b.quote(first, "kl_mean", fmt=".3g", name=False, after=f" nats at layer {int(first['layer'])}")
        b.say(" and ")
        b.quote(final, "kl_mean", fmt=".3g", name=False, after=f" at layer {int(final['layer'])}")
    else:
        return ""
    b.say(" (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(first["n_prompts"], "n_prompts", unit="prompts")
    b.say(").")
    if modal is not None:
        _modal(b, *modal)
    return b.build()
