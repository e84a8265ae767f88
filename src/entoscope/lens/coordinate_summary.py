"""Coordinate patching's table, per-prompt table, figure and takeaway (coordinate_patch.py has the maths).

Per site: `metric_base` (the unedited run's metric), `effect` (edited - unedited), `control_effect` (control -
unedited), `minus_control` (edited - control, paired per prompt), `error` (the decomposition's relative
reconstruction error) and `support_size` (its nonzero coefficients), each a mean over prompts with its
bootstrap interval (stats/); `answer_in_support`, the share of prompts whose answer token has a nonzero
coefficient, with its Wilson interval; `beats_control` (the rule of docs/pages.md, "beats its random
baseline"). The takeaway is built from claims (results/claims.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, excludes_zero
from ..results.result import Result
from ..stats import interval_columns, mean_stat, share_interval, summarise
from ..stats.columns import interval_bars, level_text
from ..results.figures import interval_note, noted

EDIT_TEXT = {"swap": "the answer's and the wrong answer's coefficients swapped",
             "substitute": "the answer's coefficient moved to the wrong answer",
             "remove": "the answer's coefficient set to zero"}
MEANS = ("metric_base", "effect", "control_effect", "minus_control", "error", "support_size")


def coordinate_result(op: Any, model: Any, siteset: Any, sites: list[dict[str, Any]], a: dict[str, np.ndarray],
                      fitted: bool = False) -> Result:
    n, U = a["edited"].shape
    base = np.repeat(np.asarray(a["base"], dtype=np.float64)[:, None], U, 1)
    values = {"metric_base": base, "effect": a["edited"] - base, "control_effect": a["control"] - base,
              "minus_control": a["edited"] - a["control"], "error": a["error"], "support_size": a["support_size"]}
    table = pd.DataFrame.from_records(sites)
    table["edit"], table["alpha"], table["metric"], table["n_prompts"] = op.edit, op.alpha, op.metric.type, n
    for name in MEANS:
        s = summarise(mean_stat(values[name]), op.stats, op.seed)
        table[name] = s.value
        for col, v in interval_columns(s, name, op.stats).items():
            table[col] = v
    share = a["answer_in_support"].mean(0)
    table["answer_in_support"] = share
    table["answer_in_support_ci_low"], table["answer_in_support_ci_high"] = share_interval(share, n, op.stats.ci_level)
    table["control_from_vocab"] = (a["from_vocab"] > 0).sum(0)
    table["beats_control"] = [beats(r) for _, r in table.iterrows()]
    table["ci_level"] = op.stats.ci_level
    vocab = model.vocab_strings()
    per_prompt = _per_prompt(sites, a, values, vocab)
    title = (f"{op.metric.type} when each prompt's Jacobian-lens coordinates are edited ({op.edit}: "
             f"{EDIT_TEXT[op.edit]}), beside as many random coordinates moved as far")
    return Result(op.name, table, per_prompt=per_prompt, figures=_figures, title=title, takeaway=_takeaway,
                  extra={"edit": op.edit, "jacobian_fitted": fitted})


def beats(row: Any) -> bool:
    """The edit beats its random control: the effect's interval excludes 0, and the interval of the paired
    difference (edited - control) excludes 0 on the effect's side."""
    if not excludes_zero(row["effect_ci_low"], row["effect_ci_high"]):
        return False
    return bool(row["minus_control_ci_low"] > 0) if row["effect"] > 0 else bool(row["minus_control_ci_high"] < 0)


def _per_prompt(sites: list[dict[str, Any]], a: dict[str, np.ndarray], values: dict[str, np.ndarray],
                vocab: Any) -> pd.DataFrame:
    n, U = a["edited"].shape
    frame = pd.DataFrame.from_records(sites)
    out = frame.loc[np.tile(np.arange(U), n)].reset_index(drop=True)
    out.insert(0, "example", np.repeat(np.arange(n), U))

    def text(ids: np.ndarray) -> list[str]:
        return [" ".join(repr(vocab[int(t)]) for t in row if t >= 0) for row in ids.reshape(n * U, -1)]
    out["token_position"] = a["position"].reshape(-1)
    out["answer"] = [vocab[int(t)] for t in np.repeat(a["answer"], U)]
    out["wrong"] = [vocab[int(t)] if t >= 0 else "" for t in np.repeat(a["wrong"], U)]
    out["coef_answer"], out["coef_wrong"] = a["coef_answer"].reshape(-1), a["coef_wrong"].reshape(-1)
    out["support_top"] = text(a["top_tokens"])
    out["support_size"], out["selected_size"] = a["support_size"].reshape(-1), a["selected_size"].reshape(-1)
    out["error"] = a["error"].reshape(-1)
    out["control_tokens"] = text(a["control_tokens"])
    drawn = a["control_tokens"].reshape(n * U, -1)
    out["control_ids"] = [" ".join(str(int(t)) for t in row if t >= 0) for row in drawn]
    out["control_from_vocab"] = a["from_vocab"].reshape(-1).astype(int)
    out["metric_base"] = values["metric_base"].reshape(-1)
    out["metric_edited"], out["metric_control"] = a["edited"].reshape(-1), a["control"].reshape(-1)
    out["effect"], out["control_effect"] = values["effect"].reshape(-1), values["control_effect"].reshape(-1)
    return out


def _figures(result: Result) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    fig = go.Figure()
    x = [str(s) for s in t["site"]]
    for col, name in (("effect", "edit"), ("control_effect", "random control")):
        fig.add_trace(go.Scatter(x=x, y=t[col], mode="lines+markers", name=name, **interval_bars(t, col, "site")))
    fig.update_layout(xaxis_title="site", yaxis_title=noted(f"change of {t['metric'].iloc[0]}",
                                                            interval_note(level_text(t))),
                      height=360, legend={"orientation": "h"})
    return [("the edit's effect and its random control's, by site", fig)]


def _takeaway(result: Result) -> Takeaway | str:
    t = result.table
    if not len(t):
        return ""
    metric = str(t["metric"].iloc[0])
    row = t.loc[t["effect"].abs().idxmax()]
    b = TakeawayBuilder(key="site")
    b.say(f"Editing each prompt's Jacobian-lens coordinates ({EDIT_TEXT[str(row['edit'])]}) changes the {metric} "
          "by the ")
    largest = b.qualify("largest", "top_by_abs")
    b.say(" amount at ")
    effect = b.quote(row, "effect", fmt="+.3g")
    b.refer(largest, [effect])
    b.say(f" (unedited {metric} ")
    b.quote(row, "metric_base", name=False, fmt=".3g")
    b.say("); as many random coordinates of the decomposition moved as far move it ")
    b.quote(row, "control_effect", name=False, fmt="+.3g")
    b.against_baseline(row, effect, minus="minus_control", beats="beats_control", what="edit", other="control",
                       baseline="control")
    b.end_lead()
    b.say(" It beats it at ")
    b.count(int(t["beats_control"].sum()), len(t), "beats_control", unit="sites")
    b.say(". The answer token is in the decomposition's support for a share ")
    b.quote(row, "answer_in_support", name=False, fmt=".2f")
    b.say(" of prompts there (reconstruction error ")
    b.quote(row, "error", name=False, fmt=".2f")
    b.say("; ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(").")
    if result.extra.get("jacobian_fitted"):
        b.say(" The Jacobian lens was fitted in this run on a few texts (a noisy lens: see the note on this page).")
    return b.build()
