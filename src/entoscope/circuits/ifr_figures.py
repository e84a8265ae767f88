"""Drawing information flow routes: residual states up (embeddings at the bottom), token positions
across, one smooth curve per kept edge with its width by importance (attention blue, MLP orange,
residual grey). Attention edges of different heads between the same two nodes arc apart; the MLP
edge arcs right of the residual edge it runs beside. Hovering an edge's middle shows its component
and importance."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from .. import naming

COLOURS = {"attention": "#2b6cb0", "mlp": "#dd6b20", "residual": "#a0aec0"}
WIDTH_BINS = 6


def _level_names(n_layers: int, parallel: bool) -> dict[int, str]:
    """The residual states by their names (naming.py): the embeddings, after each attention, after each MLP."""
    names = {0: "resid_pre.0 (embed)"}
    for L in range(n_layers):
        if parallel:
            names[L + 1] = naming.activation("resid_post", L)
        else:
            names[2 * L + 1] = naming.activation("resid_mid", L)
            names[2 * L + 2] = naming.activation("resid_post", L)
    return names


def _arc(x0: float, y0: float, x1: float, y1: float, bend: float, n: int = 9) -> tuple[list[float], list[float]]:
    """Points of a quadratic curve from (x0, y0) to (x1, y1) whose middle is pushed `bend` to the right."""
    t = np.linspace(0.0, 1.0, n)
    cx, cy = (x0 + x1) / 2 + 2 * bend, (y0 + y1) / 2
    xs = (1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1
    return xs.tolist(), ys.tolist()


def route_figure(graph: Any, title: str | None = None) -> Any:
    """A plotly figure of one route graph (a MultiDiGraph from `ifr.RouteGraphs`)."""
    import plotly.graph_objects as go

    g = graph
    pos = {n: (d["position"], d["level"]) for n, d in g.nodes(data=True)}
    n_heads = 1 + max((d.get("head", 0) for _, _, d in g.edges(data=True)), default=0)
    lines: dict[tuple[str, int], tuple[list[float | None], list[float | None]]] = {}
    mids: dict[str, tuple[list[float], list[float], list[str]]] = {k: ([], [], []) for k in COLOURS}
    for u, v, d in g.edges(data=True):
        (x0, y0), (x1, y1) = pos[u], pos[v]
        bend = 0.0
        if d["kind"] == "attention" and "head" in d:
            bend = 0.12 * (d["head"] - (n_heads - 1) / 2)
        elif d["kind"] == "mlp":
            bend = 0.25
        xm, ym = (x0 + x1) / 2 + bend, (y0 + y1) / 2
        width_bin = int(np.ceil(d["importance"] * WIDTH_BINS))
        xs, ys = lines.setdefault((d["kind"], width_bin), ([], []))
        ax, ay = _arc(x0, y0, x1, y1, bend)
        xs += ax + [None]
        ys += ay + [None]
        mx, my, text = mids[d["kind"]]
        mx.append(xm)
        my.append(ym)
        text.append(f"{d['component']}: {d['importance']:.3f}<br>{u} → {v}")
    fig = go.Figure()
    for (kind, width_bin), (xs, ys) in sorted(lines.items()):
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": COLOURS[kind], "width": 0.5 + 1.5 * width_bin}))
    for kind, (mx, my, text) in mids.items():
        if mx:
            fig.add_trace(go.Scatter(x=mx, y=my, mode="markers", name=kind, text=text, hoverinfo="text",
                                     marker={"color": COLOURS[kind], "size": 5}))
    nodes = list(g.nodes(data=True))
    fig.add_trace(go.Scatter(
        x=[d["position"] for _, d in nodes], y=[d["level"] for _, d in nodes], mode="markers", name="node",
        text=[f"{n}<br>{d['token']!r}" for n, d in nodes], hoverinfo="text",
        marker={"color": "#1a202c", "size": 7}))
    tokens = json.loads(g.graph.get("tokens", "[]"))
    levels = _level_names(int(g.graph.get("n_layers", 0)), bool(g.graph.get("parallel", False)))
    fig.update_layout(
        title=title or f"information flow routes of prompt {g.graph.get('example', '')}",
        height=180 + 45 * len(levels), hovermode="closest",
        xaxis={"title": "position: token", "tickmode": "array", "tickvals": list(range(len(tokens))),
               "ticktext": [f"{i}: {t!r}" for i, t in enumerate(tokens)], "tickangle": -45},
        yaxis={"title": "residual state", "tickmode": "array", "tickvals": list(levels),
               "ticktext": list(levels.values())},
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"})
    return fig


def component_heatmap(table: pd.DataFrame) -> Any:
    """Layer x head grid of the fraction of prompts whose route uses each head, with the MLP beside."""
    import plotly.graph_objects as go

    attn = table[table["kind"] == "attention"]
    if not len(attn):
        return None
    heads = attn.assign(col=attn["head"].fillna(-1).astype(int))
    grid = heads.pivot(index="layer", columns="col", values="in_route")
    mlp = table[table["kind"] == "mlp"].set_index("layer")["in_route"].reindex(grid.index)
    z = np.column_stack([grid.to_numpy(dtype=float), mlp.to_numpy(dtype=float)])
    x = [f"h{c}" if c >= 0 else "attn" for c in grid.columns] + ["mlp"]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=[int(v) for v in grid.index], zmin=0, zmax=1, colorscale="Viridis",
                               texttemplate="%{z:.2f}",
                               colorbar={"title": "share of prompts<br>whose route uses it"}))
    fig.update_layout(xaxis_title="head (and the layer's MLP)", yaxis_title="layer", height=140 + 40 * len(grid))
    return fig
