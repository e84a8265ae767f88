"""Drawing a circuit the way circuit papers do: input at the bottom, logits at the top, one row per layer.

Each layer's attention heads sit in a row, split around the layer's MLP near the middle (half a layer
higher in sequential blocks, where it reads the attention's output; level with the heads in parallel
blocks), the MLPs of consecutive layers a little left and right of the centre so that the input, the
MLPs and the logits never stand on one vertical line. Under grouped-query attention each key/value head
sits below its group. An edge ends at its receiver's port: a head's q, k and v inputs are three small
markers under it (left, centre, right); an edge that would pass over a node it does not touch is bent
around it (edge_paths.py). Edge colour says the score's sign (blue: positive, red: negative, with a
legend), width its |score|; hovering an edge shows its score with its interval, a node its summed score
with its interval. Buttons show the top 10 / 20 / 50 / all edges of the circuit. Nodes outside the
circuit are pale. The faithfulness curve has its interval band and marks the chosen circuit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ..stats.columns import hover_value, interval_bars, level_text
from .edge_paths import NODE_PX, PORT_PX, Canvas, route
from .graph import Circuit, Node

SIGN_COLOURS = {True: "#2b6cb0", False: "#c53030"}  # positive, negative
PORT_COLOURS = {"q": "#805ad5", "k": "#2f855a", "v": "#dd6b20"}
PORT_DX = {"q": -0.22, "k": 0.0, "v": 0.22, None: 0.0}
PORT_DY = 0.2
MLP_DX = 0.35  # the MLPs of even layers sit this far left of the centre, of odd layers right
TOP_N = (10, 20, 50)
WIDTH_PX, MARGIN_PX = 1000.0, 160.0  # the drawing's plot area (for the edges' clearance, edge_paths.py)


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
        pos[f"m{L}"] = (MLP_DX * (1 if L % 2 else -1), L + (0.0 if lay.parallel else 0.5))
        if circuit.graph.grouped:
            for j in range(lay.n_kv_heads):
                members = xs[j * g:(j + 1) * g]
                pos[f"a{L}.kv{j}"] = (sum(members) / len(members), L - 0.35)
    return pos


def _finite(x: Any) -> float:
    return float(x) if x is not None and x == x else 0.0


def port_positions(circuit: Circuit, pos: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(x, y) of each head's q / k / v input marker (`a0.h1<q>`)."""
    heads = [n for n in circuit.node_names() if Node.parse(n).kind in ("head", "kv") and n in pos]
    return {f"{n}<{qkv}>": (pos[n][0] + PORT_DX[qkv], pos[n][1] - PORT_DY) for n in heads for qkv in "qkv"}


def drawing_height(circuit: Circuit) -> int:
    return max(420, 120 * (circuit.graph.layout.n_layers + 2))


def circuit_figure(circuit: Circuit, max_edges: int = 300, title: str | None = None,
                   node_stats: dict[str, tuple[float, float, float]] | None = None,
                   sign_labels: tuple[str, str] = ("score > 0", "score < 0"),
                   edge_rows: dict[str, dict[str, Any]] | None = None, level: float = 0.95) -> Any:
    """The circuit's kept edges (the `max_edges` strongest). node_stats: name -> (value, ci_low, ci_high);
    sign_labels: the legend's words for a positive and a negative score (what the sign means for the method);
    edge_rows: each edge's table row (score and its interval, for the hover); level: the intervals' level."""
    import plotly.graph_objects as go

    pos = node_positions(circuit)
    ports = port_positions(circuit, pos)
    canvas = Canvas.of(list(pos.values()) + list(ports.values()), WIDTH_PX, drawing_height(circuit) - MARGIN_PX)
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
        start = pos[e.sender]
        end = ports[f"{e.target}<{e.qkv}>"] if e.qkv else pos[e.target]
        xs, ys = route(start, end, _obstacles(pos, ports, e.sender, f"{e.target}<{e.qkv}>" if e.qkv else e.target),
                       canvas)
        width = 1 + round(6 * abs(score) / top) if circuit.scores is not None else 2
        bucket = next(i for i, c in enumerate(cuts) if rank < c)
        grp = groups.setdefault((bucket, score >= 0, width), {"x": [], "y": []})
        grp["x"] += list(xs) + [None]
        grp["y"] += list(ys) + [None]
        h = hx.setdefault(bucket, [[], [], []])
        mid = int(0.35 * (len(xs) - 1))
        h[0].append(float(xs[mid]) if len(xs) > 2 else 0.65 * xs[0] + 0.35 * xs[-1])
        h[1].append(float(ys[mid]) if len(ys) > 2 else 0.65 * ys[0] + 0.35 * ys[-1])
        row = (edge_rows or {}).get(e.name)
        said = hover_value(row, "score") if row is not None else f"score {score:.4g}"
        h[2].append(f"{e.name}<br>{said} (rank {rank + 1})")
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
    _nodes(fig, circuit, pos, node_stats, level)
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
                      height=drawing_height(circuit), plot_bgcolor="white", hovermode="closest",
                      margin={"t": 90, "b": 70}, updatemenus=menus,
                      legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
                      xaxis={"visible": False},
                      yaxis={"title": "layer", "tickvals": list(range(-1, lay.n_layers + 1)), "zeroline": False,
                             "ticktext": ["input"] + [str(L) for L in range(lay.n_layers)] + ["logits"]})
    return fig


def _obstacles(pos: dict[str, tuple[float, float]], ports: dict[str, tuple[float, float]], sender: str,
               target: str) -> np.ndarray:
    """Every node and port an edge from `sender` to `target` (a node, or a head's input port) must keep clear
    of: all but its two ends, the sender's own ports (below it) and the receiver's node (above its port)."""
    node = target.split("<")[0]
    points = [(*p, NODE_PX) for n, p in pos.items() if n not in (sender, node)]
    points += [(*p, PORT_PX) for n, p in ports.items() if n != target and n.split("<")[0] != sender]
    return np.asarray(points, dtype=float).reshape(-1, 3)


def _ports(fig: Any, circuit: Circuit, pos: dict[str, tuple[float, float]]) -> None:
    """The q/k/v input markers under each head (one trace per port kind, named in the legend)."""
    import plotly.graph_objects as go

    heads = [n for n in circuit.node_names() if Node.parse(n).kind == "head" and n in pos]
    for qkv, colour in PORT_COLOURS.items():
        fig.add_trace(go.Scatter(x=[pos[n][0] + PORT_DX[qkv] for n in heads], y=[pos[n][1] - PORT_DY for n in heads],
                                 mode="markers", marker={"size": 5, "color": colour, "symbol": "triangle-up"},
                                 text=[f"{n}<{qkv}>" for n in heads], hoverinfo="text", name=f"{qkv} input"))


def _nodes(fig: Any, circuit: Circuit, pos: dict[str, tuple[float, float]],
           node_stats: dict[str, tuple[float, float, float]] | None, level: float) -> None:
    import plotly.graph_objects as go

    status = circuit.nodes_in_circuit()
    names = [n for n in circuit.node_names() if n in pos]
    kinds = {n: Node.parse(n).kind for n in names}
    out_score = _out_scores(circuit)

    def hover(n: str) -> str:
        text = f"{n}" + ("" if status.get(n) else " (not in the circuit)")
        if node_stats and n in node_stats:
            v, lo, hi = node_stats[n]
            text += "<br>" + hover_value({"summed_score": v, "summed_score_ci_low": lo, "summed_score_ci_high": hi,
                                          "ci_level": level}, "summed_score")
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


def faithfulness_figure(curve: pd.DataFrame | None, chosen: dict[str, Any] | None = None,
                        search: pd.DataFrame | None = None) -> Any:
    """Faithfulness over the fractions of edges kept, with its interval band; `chosen` (the run's summary)
    marks the circuit the run chose, with its faithfulness and interval; `search` (selection "target": the points
    the search read besides the curve's, search.csv) adds them as markers, with the target and the budget."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if curve is not None and len(curve):
        level = level_text(curve)
        rows = curve.to_dict("records")
        fig.add_trace(go.Scatter(x=curve["fraction"], y=curve["faithfulness"], mode="lines+markers",
                                 name="faithfulness",
                                 text=[f"{r['n_edges']} edges (fraction {r['fraction']:.3g})<br>"
                                       f"{hover_value(r, 'faithfulness')}" for r in rows],
                                 hovertemplate="%{text}<extra></extra>"))
        if "faithfulness_ci_low" in curve and curve["faithfulness_ci_low"].notna().any():
            fig.add_trace(go.Scatter(x=list(curve["fraction"]) + list(curve["fraction"])[::-1],
                                     y=list(curve["faithfulness_ci_high"]) + list(curve["faithfulness_ci_low"])[::-1],
                                     fill="toself", fillcolor="rgba(43,108,176,0.15)", line={"width": 0}, mode="lines",
                                     hoverinfo="skip", name=f"band: {level} interval over prompts",
                                     meta={"band_of": "faithfulness", "table": "faithfulness.csv", "x": "fraction"}))
    else:
        level = level_text(search) if search is not None and len(search) else level_text(chosen or {})
    if search is not None and len(search):
        rows = search.to_dict("records")
        fig.add_trace(go.Scatter(x=search["fraction"], y=search["faithfulness"], mode="markers",
                                 marker={"size": 8, "symbol": "diamond-open", "color": "#2f855a"},
                                 name="points the target search read", text=[
                                     f"the top {r['n_edges']} edges ({r['n_edges_pruned']} after pruning; {r['point']})"
                                     f"<br>{hover_value(r, 'faithfulness')}" for r in rows],
                                 hovertemplate="%{text}<extra></extra>"))
    if chosen and chosen.get("faithfulness") is not None and chosen.get("n_edges_total"):
        frame = pd.DataFrame([chosen])
        top = chosen.get("n_top", chosen["n_kept"])
        point = {"x": [top / chosen["n_edges_total"]], "y": [chosen["faithfulness"]]}
        bars = interval_bars(frame.assign(_id="summary"), "faithfulness", "_id", table="summary.json")
        if bars:
            bars["meta"]["key"] = None  # the summary file's top level
        what = "circuit found" if chosen.get("found") else "best edge set read" if "found" in chosen else \
            "chosen circuit"
        size = f"the top {top:,} edges" + (f", {chosen['n_kept']:,} after pruning" if top != chosen["n_kept"] else "")
        fig.add_trace(go.Scatter(**point, mode="markers", marker={"size": 13, "symbol": "star", "color": "#c05621"},
                                 name=f"{what}: {size} ({level} interval)",
                                 text=[f"the {what}: {size} of {chosen['n_edges_total']:,}<br>"
                                       f"{hover_value(chosen, 'faithfulness')}"],
                                 hovertemplate="%{text}<extra></extra>", **bars))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    if chosen and "faithfulness_target" in chosen:
        fig.add_hline(y=chosen["faithfulness_target"], line_dash="dash", line_color="#c05621",
                      annotation_text=f"target {chosen['faithfulness_target']:g}", annotation_position="bottom right")
        budget = chosen["max_edges"] / chosen["n_edges_total"]
        fig.add_vline(x=budget, line_dash="dash", line_color="#888")
        # the label by hand: on a log axis an annotation's x is log10 of the value, which add_vline's own label
        # does not take (it lands at 10^budget, by the full-model line)
        fig.add_annotation(x=math.log10(budget), xref="x", y=1, yref="paper", yanchor="bottom", xanchor="right",
                           text=f"budget: {chosen['max_edges']:,} edges", showarrow=False,
                           font={"size": 11, "color": "#555"})
    fig.update_layout(xaxis={"title": "fraction of edges kept (top by |score|)", "type": "log", "dtick": 1,
                             "tickformat": ".3~g"},
                      yaxis_title="faithfulness (m(C) - m(empty)) / (m(full) - m(empty))", height=380)
    return fig
