"""What an attribution graph's page shows: its takeaway (the scores with their intervals, why the mean
graph's score is not the mean of the prompts' scores, the nodes of largest attribution), a note on
reading it (error nodes, the node names), and its figures (nodes by attribution with intervals; each
prompt's scores beside the mean graph's and their mean, with intervals)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder
from ..results.figures import interval_note, noted
from ..stats.columns import both_interval_bars, interval_bars

SCORES = "scores.csv"
READING = (
    "Nodes: a feature is named after the site its dictionary reads and writes (resid_post.1.f369: feature 369 of "
    "the resid_post.1 SAE; @5 at position 5 in one prompt's graph), input is the prompt's token embeddings, "
    "metric the metric at the last position. An error node (resid_post.1.error) is the dictionary's "
    "reconstruction error at that site, x - decode(encode(x)): the part of the activation its features do "
    "not explain, kept so that the graph reproduces the model. The replacement score is the share of the "
    "tokens' influence on the metric that reaches it through features rather than through error nodes (1: "
    "the features explain the model with no error); completeness is the influence-weighted share of each "
    "node's incoming attribution from non-error nodes (Ameisen et al. 2025). The mean graph sums each "
    "prompt's positions into one node and averages the prompts' edges with their signs; its scores are "
    "computed on that mean graph, so they are not the mean of the prompts' scores: edges of opposite sign "
    "cancel before the absolute values the scores use are taken.")


def graph_takeaway(result: Any, top: int = 3) -> Takeaway | str:
    s = result.extra.get("score_table")
    if s is None or not len(s):
        return ""
    rows = s.set_index("example", drop=False)
    prompts = s[~s["example"].isin(["dataset", "mean of prompts", "dataset, |edges|"])]
    whole, mean, absolute = rows.loc["dataset"], rows.loc["mean of prompts"], rows.loc["dataset, |edges|"]
    b = TakeawayBuilder(source=SCORES, key="example")
    b.say("On these ")
    b.constant(s["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(" the mean graph's replacement score is ")
    w = b.quote(whole, "replacement", name=False)
    b.say(" and its completeness ")
    b.quote(whole, "completeness", name=False)
    b.say(" (")
    b.constant(s["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over resampled prompts).")
    b.end_lead()
    b.say(" The prompts' own replacement scores average ")
    b.quote(mean, "replacement", name=False)
    lo = prompts.loc[prompts["replacement"].astype(float).idxmin()]
    hi = prompts.loc[prompts["replacement"].astype(float).idxmax()]
    b.say(" (from ")
    b.quote(lo, "replacement", name=False, interval=False, after=f" on prompt {lo['example']}")
    b.say(" to ")
    top_prompt = b.quote(hi, "replacement", name=False, interval=False, after=f" on prompt {hi['example']}")
    b.say(").")
    if whole["replacement"] > hi["replacement"]:
        b.say(" The mean graph's score ")
        b.qualify("exceeds every prompt's", "above_all", [w, top_prompt])
        b.say(" because it is not their mean: edges are averaged with their signs, so contributions of opposite "
              "sign cancel first; averaging the absolute edges instead gives ")
    else:
        b.say(" The mean graph's score is not the prompts' mean (edges are averaged with their signs); averaging "
              "the absolute edges instead gives ")
    b.quote(absolute, "replacement", name=False, interval=False)
    b.say(".")
    t = result.table
    nodes = t[t["kind"] != "metric"]
    if len(nodes):
        b.say(" Nodes of ")
        word = b.qualify("largest |mean attribution|", "top_by_abs")
        b.say(" to the metric: ")
        refs = b.ranking(nodes, "attribution", top, key="node", source="table.csv")
        b.refer(word, refs)
        b.say(".")
    return b.build()


def graph_figures(result: Any) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    level = f"{round(100 * float(t['ci_level'].iloc[0]))}%" if "ci_level" in t and len(t) else "95%"
    top = t[t["kind"] != "metric"].head(25).iloc[::-1]
    bar = go.Figure(go.Bar(x=top["attribution"], y=top["node"], orientation="h",
                           **interval_bars(top, "attribution", "node", axis="x"),
                           marker_color=np.where(top["attribution"] >= 0, "#2b6cb0", "#c53030"),
                           text=[_hover(r, level) for _, r in top.iterrows()], hovertemplate="%{text}<extra></extra>",
                           textposition="none"))
    bar.update_layout(xaxis_title=noted("mean attribution to the metric, summed over positions",
                                        interval_note(level)), height=160 + 20 * len(top))
    s = result.extra["score_table"]
    prompts = s[~s["example"].isin(["dataset", "mean of prompts", "dataset, |edges|"])]
    pts = go.Figure(go.Scatter(x=prompts["replacement"], y=prompts["completeness"], mode="markers", name="one prompt",
                               text=[f"prompt {e}" for e in prompts["example"]]))
    for label, name, symbol in (("mean of prompts", f"mean of the prompts' scores ({level} interval)", "diamond"),
                                ("dataset", f"mean graph ({level} interval over resampled prompts)", "star")):
        row = s[s["example"] == label]
        pts.add_trace(go.Scatter(x=row["replacement"], y=row["completeness"], mode="markers", name=name,
                                 marker={"size": 13, "symbol": symbol},
                                 **both_interval_bars(row, "replacement", "completeness", "example", table=SCORES)))
    pts.update_layout(xaxis_title="replacement score", yaxis_title="completeness score", height=400)
    return [(f"top {len(top)} nodes of the mean graph by |attribution|", bar),
            ("replacement and completeness: each prompt's graph, their mean, and the mean graph (Ameisen et al. 2025)",
             pts)]


def _hover(r: pd.Series, level: str) -> str:
    text = f"{r['node']}<br>attribution {r['attribution']:.3g}"
    if pd.notna(r.get("attribution_ci_low")):
        text += f"<br>{level} CI [{r['attribution_ci_low']:.3g}, {r['attribution_ci_high']:.3g}]"
    return text + f"<br>in {int(r['prompts'])} of {int(r['n_prompts'])} prompts"
