"""Drawing a circuit the way circuit papers do: input at the bottom, logits at the top, one row per layer.

Each layer's attention heads sit in a row, split around the layer's MLP in the middle (half a layer
higher in sequential blocks, where it reads the attention's output; level with the heads in parallel
blocks). Under grouped-query attention each key/value head sits below its group. An edge ends at
its receiver's port: a head's q, k and v inputs are three small markers under it (left, centre,
right). Edge colour says the score's sign (blue: positive, red: negative, with a legend), width its
|score|; hovering a node shows its summed score (and interval when given). Buttons show the top
10 / 20 / 50 / all edges of the circuit. Nodes outside the circuit are pale.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .graph import Circuit, Node

SIGN_COLOURS = {True: "#2b6cb0", False: "#c53030"}  # positive, negative
PORT_COLOURS = {"q": "#805ad5", "k": "#2f855a", "v": "#dd6b20"}
PORT_DX = {"q": -0.22, "k": 0.0, "v": 0.22, None: 0.0}
PORT_DY = 0.2
TOP_N = (10, 20, 50)


def node_positions(circuit: Circuit) -> dict[str, tuple[float, float]]:
    """(x, y) of every node: heads around the centre, the MLP in the middle, input/logits centred."""
    lay = circuit.graph.layout
    H = lay.n_heads
    g = H // lay.n_kv_heads
    half = H / 2
    xs = [h - half + (1 if h >= half else 0) for h in range(H)]  # e.g. 4 heads: -2, -1, 1, 2; MLP at 0
    pos: dict[str, tuple[float, float]] = {"input": (0.0, -1.0), "logits": (0.0, float(lay.n_layers))}
    for L in range(lay.n_layers):
        for h in range(H):
            pos[f"a{L}.h{h}"] = (float(xs[h]), float(L))
        pos[f"m{L}"] = (0.0, L + (0.0 if lay.parallel else 0.5))
        if circuit.graph.grouped:
            for j in range(lay.n_kv_heads):
                members = xs[j * g:(j + 1) * g]
                pos[f"a{L}.kv{j}"] = (sum(members) / len(members), L - 0.35)
    return pos


def _finite(x: Any) -> float:
    return float(x) if x is not None and x == x else 0.0


def circuit_figure(circuit: Circuit, max_edges: int = 300, title: str | None = None,
                   node_stats: dict[str, tuple[float, float, float]] | None = None,
                   sign_labels: tuple[str, str] = ("score > 0", "score < 0")) -> Any:
    """The circuit's kept edges (the `max_edges` strongest). node_stats: name -> (value, ci_low, ci_high);
    sign_labels: the legend's words for a positive and a negative score (what the sign means for the method)."""
    import plotly.graph_objects as go

    pos = node_positions(circuit)
    edges = circuit.edges(only_kept=True)
    if circuit.scores is not None:
        edges.sort(key=lambda e: -abs(_finite(e.score)))
    shown = edges[:max_edges]
    top = max((abs(_finite(e.score)) for e in shown), default=0.0) or 1.0
    cuts = [n for n in TOP_N if n < len(shown)] + [len(shown)]
    groups: dict[tuple[int, bool, int], dict[str, list]] = {}
    hx: dict[int, list] = {}
    for rank, e in enumerate(shown):
        score = _finite(e.score)
        x0, y0 = pos[e.sender]
        tx, ty = pos[e.target]
        x1, y1 = tx + PORT_DX[e.qkv], ty - (PORT_DY if e.qkv else 0.0)
        width = 1 + round(6 * abs(score) / top) if circuit.scores is not None else 2
        bucket = next(i for i, c in enumerate(cuts) if rank < c)
        grp = groups.setdefault((bucket, score >= 0, width), {"x": [], "y": []})
        grp["x"] += [x0, x1, None]
        grp["y"] += [y0, y1, None]
        h = hx.setdefault(bucket, [[], [], []])
        h[0].append(0.65 * x0 + 0.35 * x1)
        h[1].append(0.65 * y0 + 0.35 * y1)
        h[2].append(f"{e.name}<br>score {score:.4g} (rank {rank + 1})")
    fig = go.Figure()
    traces_bucket: list[int | None] = []
    for (bucket, positive, width), xy in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        fig.add_trace(go.Scatter(x=xy["x"], y=xy["y"], mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": SIGN_COLOURS[positive], "width": width}, opacity=0.7))
        traces_bucket.append(bucket)
    for bucket, (x, y, text) in sorted(hx.items()):
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", marker={"size": 8, "opacity": 0}, text=text,
                                 hoverinfo="text", showlegend=False))
        traces_bucket.append(bucket)
    _ports(fig, circuit, pos)
    _nodes(fig, circuit, pos, node_stats)
    for positive, label in zip((True, False), sign_labels):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": SIGN_COLOURS[positive], "width": 4},
                                 name=label))
    n_fixed = len(fig.data) - len(traces_bucket)
    buttons = []
    for i, c in enumerate(cuts):
        visible = [b is not None and b <= i for b in traces_bucket] + [True] * n_fixed
        buttons.append({"label": f"top {c}" if i < len(cuts) - 1 else f"all {c}", "method": "restyle",
                        "args": [{"visible": visible}]})
    lay = circuit.graph.layout
    note = f" (the {max_edges} strongest of {len(edges)} edges drawn)" if len(edges) > max_edges else ""
    menus = [{"type": "buttons", "direction": "right", "x": 0.0, "y": -0.02, "xanchor": "left", "yanchor": "top",
              "buttons": buttons, "showactive": True, "active": len(cuts) - 1, "pad": {"t": 4, "b": 4}}] \
        if len(cuts) > 1 else []
    fig.update_layout(title={"text": (title or f"circuit: {circuit.n_kept} of {circuit.graph.n_edges} edges") + note,
                             "y": 0.98, "yanchor": "top"},
                      height=max(420, 120 * (lay.n_layers + 2)), plot_bgcolor="white", hovermode="closest",
                      margin={"t": 90, "b": 70}, updatemenus=menus,
                      legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
                      xaxis={"visible": False},
                      yaxis={"title": "layer", "tickvals": list(range(-1, lay.n_layers + 1)), "zeroline": False,
                             "ticktext": ["input"] + [str(L) for L in range(lay.n_layers)] + ["logits"]})
    return fig


def _ports(fig: Any, circuit: Circuit, pos: dict[str, tuple[float, float]]) -> None:
    """The q/k/v input markers under each head (one trace per port kind, named in the legend)."""
    import plotly.graph_objects as go

    heads = [n for n in circuit.node_names() if Node.parse(n).kind == "head" and n in pos]
    for qkv, colour in PORT_COLOURS.items():
        fig.add_trace(go.Scatter(x=[pos[n][0] + PORT_DX[qkv] for n in heads], y=[pos[n][1] - PORT_DY for n in heads],
                                 mode="markers", marker={"size": 5, "color": colour, "symbol": "triangle-up"},
                                 text=[f"{n}<{qkv}>" for n in heads], hoverinfo="text", name=f"{qkv} input"))


def _nodes(fig: Any, circuit: Circuit, pos: dict[str, tuple[float, float]],
           node_stats: dict[str, tuple[float, float, float]] | None) -> None:
    import plotly.graph_objects as go

    status = circuit.nodes_in_circuit()
    names = [n for n in circuit.node_names() if n in pos]
    kinds = {n: Node.parse(n).kind for n in names}
    out_score = _out_scores(circuit)

    def hover(n: str) -> str:
        text = f"{n}" + ("" if status.get(n) else " (not in the circuit)")
        if node_stats and n in node_stats:
            v, lo, hi = node_stats[n]
            text += f"<br>summed score {v:.4g} [{lo:.3g}, {hi:.3g}]"
        elif n in out_score:
            text += f"<br>summed score of its kept edges {out_score[n]:.4g}"
        return text
    fig.add_trace(go.Scatter(
        x=[pos[n][0] for n in names], y=[pos[n][1] for n in names], mode="markers+text",
        text=[n for n in names], textposition="middle right", textfont={"size": 9},
        hovertext=[hover(n) for n in names], hoverinfo="text",
        marker={"size": [16 if kinds[n] != "kv" else 9 for n in names],
                "color": ["#ffa600" if status[n] else "#eeeeee" for n in names],
                "symbol": ["square" if kinds[n] in ("mlp", "input", "logits") else "circle" for n in names],
                "line": {"color": "#444", "width": 1}},
        showlegend=False))


def _out_scores(circuit: Circuit) -> dict[str, float]:
    if circuit.scores is None:
        return {}
    out: dict[str, float] = {}
    for e in circuit.edges(only_kept=True):
        out[e.sender] = out.get(e.sender, 0.0) + _finite(e.score)
    return out


def faithfulness_figure(curve: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=curve["fraction"], y=curve["faithfulness"], mode="lines+markers",
                               text=[f"{n} edges" for n in curve["n_edges"]],
                               hovertemplate="%{x:.3g}: f=%{y:.3f}, %{text}"))
    if "faithfulness_ci_low" in curve and curve["faithfulness_ci_low"].notna().any():
        fig.add_trace(go.Scatter(x=list(curve["fraction"]) + list(curve["fraction"])[::-1],
                                 y=list(curve["faithfulness_ci_high"]) + list(curve["faithfulness_ci_low"])[::-1],
                                 fill="toself", fillcolor="rgba(43,108,176,0.15)", line={"width": 0},
                                 hoverinfo="skip", name="95% interval over prompts"))
        fig.data[0].name = "faithfulness"
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    fig.update_layout(xaxis={"title": "fraction of edges kept (top by |score|)", "type": "log", "dtick": 1,
                             "tickformat": ".3~g"},
                      yaxis_title="faithfulness (m(C) - m(empty)) / (m(full) - m(empty))", height=360)
    return fig
