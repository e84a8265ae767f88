"""The parameter lens's takeaway (and the decoder lens's, which reads dictionary rows the same way): the
units whose vector scores highest against one token, each with the token it promotes and the one it
suppresses. Weights only: no prompts, so no interval; every number is a quoted cell (results/claims.py)
and the one qualifier, "largest top score", follows the rule top_by_value (docs/pages.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder

SPACES = {"unembed": "through W_U (v @ W_U, the logits the vector adds; raw dot products, no final norm)",
          "embed": "against the token embeddings (v . W_E[t]; raw dot products)"}


def parameter_takeaway(result: Any, *, name_of: Callable[[Any], str], keys: tuple[str, ...], reading: str,
                       top: int = 3) -> Takeaway | str:
    """`name_of(row)`: the unit's name in the naming scheme; `keys`: the table columns that identify a row;
    `reading`: how the vectors were read (a phrase)."""
    t = result.table
    if not len(t) or "top1_score" not in t:
        return ""
    ranked = t.sort_values("top1_score", ascending=False, kind="stable").head(top)
    b = TakeawayBuilder(key=keys)
    b.say(f"Weights read {reading}; weights only, so no prompts and no interval. The units of the table with "
          "the ")
    word = b.qualify("largest top score", "top_by_value")
    b.say(": ")
    refs = []
    for i, (_, row) in enumerate(ranked.iterrows()):
        b.say("; " if i else "")
        refs.append(b.quote(row, "top1_score", name=f"{name_of(row)}:", fmt=".3g", interval=False, q=False))
        b.say(f" for {row['top1_token']!r} (lowest: {row['bottom1_token']!r} ")
        b.quote(row, "bottom1_score", name=False, fmt=".3g", interval=False, q=False)
        b.say(")")
    b.refer(word, refs)
    b.say(".")
    return b.build()
