"""Drawing a circuit: layers up, components across, edge width by |score| (plotly).

Nodes: `input` at the bottom, then per layer the attention heads (left to right) with the MLP to
their right (half a layer higher in sequential blocks, level with attention in parallel ones), and
`logits` at the top; under grouped-query attention each key/value head sits just below its group.
An edge ends at its receiver's port: q, k, v slightly left / centre / right below the head. Colour
says the receiver (q blue, k green, v red, MLP and logits grey), width |score| (relative to the
largest drawn), dashes a negative score. Nodes out of the circuit are pale.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .graph import Circuit, Node

COLOURS = {"q": "#1f77b4", "k": "#2ca02c", "v": "#d62728", None: "#7f7f7f"}
PORT_DX = {"q": -0.2, "k": 0.0, "v": 0.2, None: 0.0}


def _positions(circuit: Circuit) -> dict[str, tuple[float, float]]:
    lay = circuit.graph.layout
    H = lay.n_heads
    g = H // lay.n_kv_heads
    pos: dict[str, tuple[float, float]] = {"input": ((H - 1) / 2, -1.0), "logits": ((H - 1) / 2, float(lay.n_layers))}
    for L in range(lay.n_layers):
        for h in range(H):
            pos[f"a{L}.h{h}"] = (float(h), float(L))
        pos[f"m{L}"] = (H + 0.5, L + (0.0 if lay.parallel else 0.5))
        if circuit.graph.grouped:
            for j in range(lay.n_kv_heads):
                pos[f"a{L}.kv{j}"] = (j * g + (g - 1) / 2, L - 0.35)
    return pos


def circuit_figure(circuit: Circuit, max_edges: int = 300, title: str | None = None) -> Any:
    import plotly.graph_objects as go

    pos = _positions(circuit)
    edges = circuit.edges(only_kept=True)
    if circuit.scores is not None:
        edges.sort(key=lambda e: -abs(e.score or 0.0) if e.score == e.score else 0.0)
    shown = edges[:max_edges]
    top = max((abs(e.score) for e in shown if e.score is not None and e.score == e.score), default=0.0) or 1.0
    groups: dict[tuple, dict[str, list]] = {}
    hover_x, hover_y, hover_text = [], [], []
    for e in shown:
        score = e.score if e.score is not None and e.score == e.score else 0.0
        x0, y0 = pos[e.sender]
        tx, ty = pos[e.target]
        x1, y1 = tx + PORT_DX[e.qkv], ty - (0.15 if e.qkv else 0.0)
        width = 1 + round(5 * abs(score) / top) if circuit.scores is not None else 2
        key = (e.qkv, width, score < 0)
        grp = groups.setdefault(key, {"x": [], "y": []})
        grp["x"] += [x0, x1, None]
        grp["y"] += [y0, y1, None]
        hover_x.append((x0 + x1) / 2)
        hover_y.append((y0 + y1) / 2)
        hover_text.append(f"{e.name}<br>score {score:.4g}")
    fig = go.Figure()
    for (qkv, width, negative), xy in sorted(groups.items(), key=lambda kv: kv[0][1]):
        fig.add_trace(go.Scatter(x=xy["x"], y=xy["y"], mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": COLOURS[qkv], "width": width, "dash": "dash" if negative else "solid"},
                                 opacity=0.75))
    fig.add_trace(go.Scatter(x=hover_x, y=hover_y, mode="markers", marker={"size": 6, "opacity": 0},
                             text=hover_text, hoverinfo="text", showlegend=False))
    status = circuit.nodes_in_circuit()
    names = [n for n in circuit.node_names() if n in pos]
    kinds = {n: Node.parse(n).kind for n in names}
    fig.add_trace(go.Scatter(
        x=[pos[n][0] for n in names], y=[pos[n][1] for n in names], mode="markers+text",
        text=[n for n in names], textposition="top center", textfont={"size": 9}, hoverinfo="text",
        marker={"size": [14 if kinds[n] != "kv" else 9 for n in names],
                "color": ["#ffa600" if status[n] else "#e5e5e5" for n in names],
                "symbol": ["square" if kinds[n] in ("mlp", "input", "logits") else "circle" for n in names],
                "line": {"color": "#444", "width": 1}},
        showlegend=False))
    for qkv, label in (("q", "query"), ("k", "key"), ("v", "value"), (None, "MLP / logits")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": COLOURS[qkv], "width": 3},
                                 name=label))
    lay = circuit.graph.layout
    note = f" (the {max_edges} strongest of {len(edges)} edges drawn)" if len(edges) > max_edges else ""
    fig.update_layout(title=(title or f"circuit: {circuit.n_kept} of {circuit.graph.n_edges} edges") + note,
                      height=max(360, 110 * (lay.n_layers + 2)), plot_bgcolor="white",
                      xaxis={"visible": False}, yaxis={"title": "layer", "tickvals": list(range(-1, lay.n_layers + 1)),
                                                       "ticktext": ["input"] + [str(L) for L in range(lay.n_layers)]
                                                       + ["logits"], "zeroline": False})
    return fig


def faithfulness_figure(curve: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=curve["fraction"], y=curve["faithfulness"], mode="lines+markers",
                               text=[f"{n} edges" for n in curve["n_edges"]],
                               hovertemplate="%{x:.3g}: f=%{y:.3f}, %{text}"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    fig.update_layout(xaxis={"title": "fraction of edges kept (top by |score|)", "type": "log"},
                      yaxis_title="faithfulness (m(C) - m(empty)) / (m(full) - m(empty))", height=360)
    return fig
