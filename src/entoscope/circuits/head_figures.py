"""Head scores drawn side by side: one layer x head heatmap per kind (previous-token, duplicate-token,
induction) on one 0-1 colour scale, so a reader compares kinds at a glance."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..stats.columns import hover_value

SCALE_TITLE = "score (share of its<br>attention on targets)"


def head_score_panels(table: pd.DataFrame, column: str = "score") -> Any:
    """One heatmap per kind of `table` (HeadScores' table: kind, layer, head, score[, CI columns])."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = list(dict.fromkeys(table["kind"]))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[k.replace("_", "-") for k in kinds],
                        shared_yaxes=True, horizontal_spacing=0.04)
    for i, kind in enumerate(kinds, start=1):
        sub = table[table["kind"] == kind]
        grid = sub.pivot_table(index="layer", columns="head", values=column, aggfunc="first")
        hover = sub.assign(_h=sub.apply(lambda r: _hover(r, column), axis=1)).pivot_table(
            index="layer", columns="head", values="_h", aggfunc="first").reindex(index=grid.index, columns=grid.columns)
        fig.add_trace(go.Heatmap(z=grid.values, x=[f"h{int(h)}" for h in grid.columns],
                                 y=[int(L) for L in grid.index], zmin=0, zmax=1, colorscale="Viridis",
                                 texttemplate="%{z:.2f}", text=hover.values, hovertemplate="%{text}<extra></extra>",
                                 showscale=i == len(kinds), colorbar={"title": SCALE_TITLE, "thickness": 14}),
                      row=1, col=i)
        fig.update_xaxes(title_text="head", row=1, col=i)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    n_layers = table["layer"].nunique()
    fig.update_layout(height=max(300, 150 + 45 * n_layers))
    return fig


def _hover(r: Any, column: str) -> str:
    text = f"{r['kind'].replace('_', '-')} {r['site']}<br>{hover_value(r, column)}"
    return text + (f"<br>n = {int(r['n_prompts'])}" if "n_prompts" in r else "")
