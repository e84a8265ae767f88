"""The interchange table, its figure and its takeaway.

One row per (cell, condition): `none` (no intervention: how often the base's own output already is the
high-level model's prediction), `full` (the whole vector interchanged at that token), each basis and each
basis's placebo. IIA is the share of held-out pairs whose class logits' argmax is the high-level model's
prediction under the interchange (Geiger et al. 2021); `iia_changed` is the same on the held-out pairs
where the interchange changes that prediction (the others a run passes by doing nothing). Intervals:
Wilson's over pairs (stats/proportion.py). `das_overlap` (mean squared cosine of the principal angles with
the cell's DAS subspace) and `das_angle` (the smallest principal angle, degrees) are properties of the bases
(made once from the training pairs), not aggregates over held-out pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder, most
from ..stats.proportion import wilson_interval
from .bases import overlap
from .runs import PLACEBO

KEY = ("site", "basis")


def interchange_table(st: Any, clean: np.ndarray, right: np.ndarray, ctx: Any, level: float,
                      strength: float) -> pd.DataFrame:
    pairs = st.pairs
    P = len(pairs)
    test = np.flatnonzero(st.held)
    target = pairs.target[test]
    own = np.argmax(clean[test], axis=1)
    base_value = np.where(pairs.base_value[test] >= 0, pairs.base_value[test], own)
    changed = target != base_value
    rows = []
    for k, cell in enumerate(st.cells):
        das = ctx.bases[k].get("das")
        values = [("none", "none", 0, (own == target).astype(float))]
        for j, (name, mode) in enumerate(st.conditions):
            label = f"{name} placebo" if mode == PLACEBO else name
            kind = "placebo" if mode == PLACEBO else ("full" if name == "full" else "basis")
            rank = st.width if name == "full" else int(ctx.bases[k][name].shape[1])
            values.append((label, kind, rank, right[:P][test, k, j]))
        for label, kind, rank, ok in values:
            row: dict[str, Any] = {"site": cell.label, "activation": cell.act.kind, "layer": cell.layer,
                                   "head": cell.head, "position": cell.position, "basis": label, "kind": kind,
                                   "rank": rank}
            for col, mask in (("iia", np.ones(len(ok), bool)), ("iia_changed", changed)):
                n = int(mask.sum())
                hits = float(ok[mask].sum())
                low, high = wilson_interval(np.array(hits), n, level)
                row[col] = hits / n if n else np.nan
                row[f"{col}_ci_low"], row[f"{col}_ci_high"] = float(low), float(high)
            row["n_pairs"], row["n_changed"] = len(ok), int(changed.sum())
            name = label.removesuffix(" placebo")
            if das is not None and kind == "basis" and name in ctx.bases[k] and name != "das":
                row["das_overlap"], row["das_angle"] = overlap(_t(das), _t(ctx.bases[k][name]))
            else:
                row["das_overlap"], row["das_angle"] = np.nan, np.nan
            row["strength"], row["ci_level"] = strength, level
            rows.append(row)
    table = pd.DataFrame(rows)
    table["head"] = table["head"].astype("Int64")
    return table


def _t(a: np.ndarray) -> Any:
    import torch
    return torch.from_numpy(a)


def best_cell(t: pd.DataFrame, basis: str) -> Any:
    """The row of `basis` with the largest IIA on the changed pairs (ties: the first cell)."""
    sub = t[t["basis"] == basis]
    col = "iia_changed" if sub["n_changed"].iloc[0] > 0 else "iia"
    return sub.loc[sub[col].astype(float).fillna(-1).idxmax()], col


NAMED = 8  # cells named in each list of the whole-vector sentence


def _whole_vector(b: TakeawayBuilder, t: pd.DataFrame, variable: str, col: str) -> None:
    """The whole vector first (the clear result: where the variable sits at all): the cells where interchanging
    it gives the high-level prediction on most pairs (rule `most`), grouped by position: the lead; then the
    others."""
    full = t[t["basis"] == "full"]
    which = "the pairs it changes" if col == "iia_changed" else "the held-out pairs"
    carries = [bool(most(r[col], r.get(f"{col}_ci_low"))) for _, r in full.iterrows()]
    yes, no = full[carries], full[[not c for c in carries]]
    b.say(f"Variable {variable}: interchanging the whole vector gives the high-level model's prediction on ")
    if len(yes):
        word = b.qualify(f"most of {which}", "most")
        refs: list[int] = []
        for i, (position, rows) in enumerate(yes.groupby("position", sort=False)):
            b.say(f"{'; ' if i else ' '}at {position}: ")
            for j, (_, r) in enumerate(rows.head(NAMED).iterrows()):
                b.say(", " if j else "")
                refs.append(b.quote(r, col, fmt=".2f", name=str(r["site"])))
        b.refer(word, refs)
        b.say(". So the variable sits, whole, at these cells. ")
        b.end_lead()
        if len(no):
            b.say("At the other cells, ")
            other = b.qualify("not most", "not_most")
            b.say(" (")
            refs = []
            for j, (_, r) in enumerate(no.head(NAMED).iterrows()):
                b.say(", " if j else "")
                refs.append(b.quote(r, col, fmt=".2f", name=str(r["site"])))
            b.refer(other, refs)
            b.say(", ..." if len(no) > NAMED else "")
            b.say("). ")
        return
    word = b.qualify(f"most of {which}", "not_most")
    b.say(" at no cell (")
    highest = b.qualify("highest", "top_by_value", condition="basis=full")
    b.say(": ")
    best = full.loc[full[col].astype(float).fillna(-1).idxmax()]
    ref = b.quote(best, col, fmt=".2f", name=str(best["site"]))
    b.refer(word, [ref])
    b.refer(highest, [ref])
    b.say("): no cell of this grid carries the variable whole. ")
    b.end_lead()


def interchange_takeaway(result: Any) -> Takeaway | str:
    t = result.table
    if not len(t):
        return ""
    variable = result.extra.get("variable", "the variable")
    learned = [b for b in t["basis"].unique() if t[t["basis"] == b]["kind"].iloc[0] == "basis"]
    if not learned:
        return ""
    main = "das" if "das" in learned else learned[0]
    row, col = best_cell(t, main)
    b = TakeawayBuilder(key=KEY)
    which = "the pairs whose output the interchange changes" if col == "iia_changed" else "every pair"
    if (t["basis"] == "full").any():
        _whole_vector(b, t, variable, col)
        b.say(f"The {main} subspace (rank {int(row['rank'])}): the ")
    else:
        b.say(f"Variable {variable}, {main} subspace (rank {int(row['rank'])}): the ")
    word = b.qualify("highest", "top_by_value", condition=f"basis={main}")
    b.say(f" IIA on {which} is at {row['site']}, ")
    mine = b.quote(row, col, name=False, fmt=".2f")
    b.refer(word, [mine])
    b.say(" (")
    b.constant(row["n_changed"] if col == "iia_changed" else row["n_pairs"], "n_changed" if col == "iia_changed"
               else "n_pairs", unit="held-out pairs")
    b.say(", Wilson ")
    b.constant(row["ci_level"], "ci_level", fmt=".0%")
    b.say(" intervals)")
    same = t[t["site"] == row["site"]]
    placebo = same[same["basis"] == f"{main} placebo"]
    if len(placebo):
        b.say("; its placebo, a random subspace moved exactly as far, gives ")
        other = b.quote(placebo.iloc[0], col, name=False, fmt=".2f")
        b.say(": the interval ")
        b.separation(mine, other, above="lies above the placebo's (the subspace carries the variable there)",
                     overlap="overlaps the placebo's (no evidence that the subspace carries the variable)")
    none = same[same["basis"] == "none"]
    b.say(".")
    if not (t["basis"] == "full").any():
        b.end_lead()
    b.say(" Without intervention the base's own output gives ")
    b.quote(none.iloc[0], col, name=False, fmt=".2f")
    full = same[same["basis"] == "full"]
    if len(full):
        b.say(", and interchanging the whole vector there ")
        b.quote(full.iloc[0], col, name=False, fmt=".2f")
    fixed = same[(same["kind"] == "basis") & (same["basis"] != main)]
    if len(fixed):
        b.say(". The other bases there: ")
        for i, (_, other_row) in enumerate(fixed.iterrows()):
            if i:
                b.say(", ")
            b.quote(other_row, col, fmt=".2f")
    b.say(".")
    return b.build()


def interchange_figures(result: Any) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    col = "iia_changed" if int(t["n_changed"].iloc[0]) > 0 else "iia"
    level = f"{round(100 * float(t['ci_level'].iloc[0]))}% Wilson interval"
    fig = go.Figure()
    sites = list(dict.fromkeys(t["site"]))
    for basis in dict.fromkeys(t["basis"]):
        sub = t[t["basis"] == basis].set_index("site").loc[sites]
        v = sub[col].to_numpy(float)
        fig.add_trace(go.Bar(x=sites, y=v, name=basis, opacity=0.45 if basis.endswith("placebo") else 1.0,
                             error_y={"type": "data", "symmetric": False,
                                      "array": sub[f"{col}_ci_high"].to_numpy(float) - v,
                                      "arrayminus": v - sub[f"{col}_ci_low"].to_numpy(float)}))
    fig.update_layout(barmode="group", title=f"interchange-intervention accuracy by site and basis ({col}; error "
                      f"bars: {level} over held-out pairs)", xaxis_title="site", yaxis_title=col,
                      yaxis={"range": [0, 1.05]})
    figs = [("IIA by site and basis", fig)]
    ov = t[t["das_overlap"].notna()]
    if len(ov):
        heat = ov.pivot_table(index="basis", columns="site", values="das_overlap", sort=False)
        fig2 = go.Figure(go.Heatmap(z=heat.to_numpy(float), x=list(heat.columns), y=list(heat.index),
                                    zmin=0, zmax=1, colorscale="Blues", colorbar={"title": "overlap"}))
        fig2.update_layout(title="the DAS subspace's overlap with each fixed basis (mean squared cosine of the "
                           "principal angles; 1: the same subspace)", xaxis_title="site", yaxis_title="basis")
        figs.append(("DAS overlap with the fixed bases", fig2))
    return figs
