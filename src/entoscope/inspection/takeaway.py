"""What an inspection's numbers say, in sentences computed from its tables: the takeaway (the model's
prediction at the last position, and the answer's place in it) and one line per view (the lens, the
attribution, the patching). One prompt: every number is this run's own value, exact, with nothing to resample,
so no interval; "largest" is a ranking of these values (docs/pages.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .figures import metric_label, shown


def prob_text(p: float) -> str:
    """A probability with three significant digits, more where three would round it to 1 (0.99994, not 1)."""
    text = f"{p:.3g}"
    return f"{p:.6g}" if text == "1" and p < 1 else text


def inspect_takeaway(result: Any) -> str:
    """The model's top predictions at the last position; with an answer, its rank and probability there
    (and the logit difference against the wrong answer)."""
    t = result.table
    last = t.iloc[-1]
    k = sum(1 for c in t.columns if c.startswith("top") and c.endswith("_token"))
    runners = ", ".join(f"{shown(last[f'top{i}_token'])} ({prob_text(last[f'top{i}_prob'])})"
                        for i in range(2, min(k, 3) + 1))
    text = (f"After the last token {shown(last['token'])} (position {int(last['position'])}), the model's top "
            f"prediction is {shown(last['top1_token'])} with probability {prob_text(last['top1_prob'])}"
            + (f", then {runners}." if runners else "."))
    if "answer" in t and isinstance(last.get("answer"), str):
        rank = int(last["answer_rank"])
        where = "is its top token" if rank == 0 else f"has {rank} token{'s' if rank > 1 else ''} above it"
        text += f" The answer {shown(last['answer'])} {where} (probability {prob_text(last['answer_prob'])})"
        if "logit_diff" in t and isinstance(last.get("wrong"), str):
            diff = float(last["logit_diff"])
            wrong = shown(last["wrong"])
            text += (f"; its logit exceeds that of the wrong answer {wrong} by {diff:.3g}" if diff >= 0 else
                     f"; the logit of the wrong answer {wrong} exceeds its own by {-diff:.3g}")
        text += "."
    return text


def lens_line(lens: pd.DataFrame, name: str, token: str, what: str) -> str:
    """From which layer on `token` is the lens's top token at the last position (and stays so)."""
    last = lens[lens["position"] == lens["position"].max()].sort_values("layer")
    top = last["top1_token"].to_numpy() == token
    if not len(last):
        return ""
    if not top[-1]:
        best = last.iloc[int(np.argmax(last["answer_prob"]))] if "answer_prob" in last else None
        text = f"At the last position the {name} lens never ends on {what} {shown(token)}"
        if best is not None:
            fewest = int(last["answer_rank"].min())
            text += f" (at best {fewest} token{'s' if fewest != 1 else ''} above it; its highest probability " \
                    f"{best['answer_prob']:.3g} at layer {int(best['layer'])})"
        return text + "."
    from_layer = int(last["layer"].to_numpy()[len(top) - int(np.argmin(top[::-1])) if not top.all() else 0])
    first = int(last["layer"].to_numpy()[int(np.argmax(top))])
    text = f"At the last position {what} {shown(token)} is the {name} lens's top token from layer {from_layer} on"
    if first < from_layer:
        text += f" (first at layer {first})"
    return text + "."


def dla_line(dla: pd.DataFrame, terms: dict[str, Any], label: str) -> str:
    """The rows of largest |contribution| and the identity they satisfy."""
    rows = dla[dla["kind"] != "constant"]
    top = rows.reindex(rows["contribution"].abs().sort_values(ascending=False).index).head(3)
    named = ", ".join(f"{r.component} {r.contribution:+.3g}" for r in top.itertuples())
    return (f"The largest direct contributions to {label} are {named} (a ranking of this prompt's values); every row, "
            f"with the constant {terms['constant']:+.3g}, sums to {terms['sum_of_rows'] + terms['constant']:.4g}, the "
            f"model's own {label} = {terms['value']:.4g}.")


def patching_line(patching: pd.DataFrame, terms: dict[str, Any]) -> str:
    """The cells that restore the most, and the two runs' metrics."""
    label = metric_label(terms["metric"], terms["answer"], terms["wrong"])
    base = (f"{label} is {terms['clean']:.4g} on the prompt and {terms['corrupt']:.4g} on the counterfactual")
    if patching["normalized"].isna().all():
        return base + ": the two runs agree, so no cell has a normalised value."
    top = patching.reindex(patching["normalized"].sort_values(ascending=False).index).head(3)
    cells = ", ".join(f"{r.site} ({shown(r.token)}) {r.normalized:.3g}" for r in top.itertuples())
    return base + f"; the cells that restore the most of it (normalised, 1 = the prompt's value) are {cells}."
