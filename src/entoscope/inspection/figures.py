"""The plotly figures of an inspection: the direct logit attribution (every head and MLP by layer; the largest
rows) and the patching map (layer x position). Their house rules (colour scales centred at 0, heights, integer
axes) are results/figures.py's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .. import naming

TOP_ROWS = 15  # rows of the attribution bar chart


def shown(token: Any) -> str:
    """A token as figures and grids write it: repr-quoted, so that leading spaces and empty tokens show."""
    return repr(str(token))


def metric_label(metric: str, answer: str | None, wrong: str | None) -> str:
    """'logit(' Paris') - logit(' Rome')' or 'logit(' Paris')': what the attribution and patching read."""
    if metric == "logit_diff" and wrong is not None:
        return f"logit({shown(answer)}) - logit({shown(wrong)})"
    return f"logit({shown(answer)})"


def dla_figures(dla: pd.DataFrame, label: str) -> list[tuple[str, Any]]:
    """Every head (and each layer's MLP) by layer, and the rows of largest |contribution|."""
    import plotly.graph_objects as go

    heads = dla[dla["kind"] == "head"]
    grid = heads.pivot(index="layer", columns="head", values="contribution")
    mlp = dla[dla["kind"] == "mlp"].set_index("layer")["contribution"].reindex(grid.index)
    z = np.column_stack([grid.to_numpy(dtype=float), mlp.to_numpy(dtype=float)])
    names = [[naming.head(int(L), int(h)) for h in grid.columns] + [naming.mlp(int(L))] for L in grid.index]
    hover = [[f"{names[i][j]}: {z[i, j]:+.4f}" for j in range(z.shape[1])] for i in range(z.shape[0])]
    heat = go.Figure(go.Heatmap(z=z, x=[f"h{int(h)}" for h in grid.columns] + ["mlp"], y=[int(L) for L in grid.index],
                                customdata=hover, hovertemplate="%{customdata}<extra></extra>", texttemplate="%{z:.2f}",
                                colorbar={"title": "direct<br>contribution"}))
    heat.update_layout(xaxis_title="head (and the layer's MLP)", yaxis_title="layer")
    heat.update_yaxes(autorange="reversed")
    top = dla.reindex(dla["contribution"].abs().sort_values(ascending=False).index).head(TOP_ROWS).iloc[::-1]
    bar = go.Figure(go.Bar(x=top["contribution"], y=top["component"], orientation="h",
                           marker_color=np.where(top["contribution"] >= 0, "#2b6cb0", "#c53030"),
                           hovertemplate="%{y}: %{x:+.4f}<extra></extra>"))
    bar.update_layout(xaxis_title=f"direct contribution to {label}", height=160 + 22 * len(top))
    return [(f"direct contribution to {label} by layer and head (the last column: the layer's MLP)", heat),
            (f"the {len(top)} rows of largest |contribution|", bar)]


def patching_figure(patching: pd.DataFrame, label: str) -> tuple[str, Any]:
    """The normalised patched metric by layer (rows) and position (columns, the prompt's tokens)."""
    import plotly.graph_objects as go

    grid = patching.pivot(index="layer", columns="position", values="normalized")
    raw = patching.pivot(index="layer", columns="position", values="patched")
    first = patching.drop_duplicates("position").set_index("position")
    x = [f"{p} {shown(first.loc[p, 'token'])}" + ("" if first.loc[p, "token"] == first.loc[p, "counterfactual_token"]
                                                  else f"/{shown(first.loc[p, 'counterfactual_token'])}")
         for p in grid.columns]
    hover = [[f"resid_pre.{L}@{p} {x[j]}<br>normalised {grid.iloc[i, j]:.3f}<br>patched {label} {raw.iloc[i, j]:.4f}"
              for j, p in enumerate(grid.columns)] for i, L in enumerate(grid.index)]
    heat = go.Figure(go.Heatmap(z=grid.to_numpy(dtype=float), x=x, y=[int(L) for L in grid.index], customdata=hover,
                                hovertemplate="%{customdata}<extra></extra>", zmid=0, colorscale="RdBu",
                                colorbar={"title": "normalised<br>(1 = prompt,<br>0 = counterfactual)"}))
    heat.update_layout(xaxis_title="position: token (prompt/counterfactual where they differ)", yaxis_title="layer")
    heat.update_yaxes(autorange="reversed")
    return (f"{label} when resid_pre of one layer and position of the counterfactual run is patched from the "
            "prompt's run (normalised)", heat)
