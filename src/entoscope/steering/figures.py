"""Figures of a steering Result: the dose-response against the random baseline, side effects against the
effect, side effects and task scores against the coefficient, and the continuations.

Every band and error bar is the table's `<column>_ci_low` / `_ci_high` (the bootstrap interval over
prompts, its level named in the legend); the random direction of the same norm is on every figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..stats.columns import both_interval_bars, interval_bars

COLOURS = {"direction": "#1f77b4", "random": "#7f7f7f"}
NAMES = {"direction": "the direction", "random": "random direction (same norm)"}
TASK_COLOURS = ["#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]


def _level(t: pd.DataFrame) -> str:
    return f"{round(100 * float(t['ci_level'].iloc[0]))}% interval"


def _band(fig: Any, sub: pd.DataFrame, column: str, colour: str, name: str, row: int | None = None,
          col: int | None = None, show: bool = True) -> None:
    """A line with its interval band (a filled polygon over ci_low..ci_high), the level named in the legend."""
    import plotly.graph_objects as go

    sub = sub.sort_values("coefficient")
    x = sub["coefficient"].to_numpy(float)
    low, high = sub[f"{column}_ci_low"].to_numpy(float), sub[f"{column}_ci_high"].to_numpy(float)
    where = {"row": row, "col": col} if row is not None else {}
    if np.isfinite(low).any():
        fig.add_trace(go.Scatter(x=np.concatenate([x, x[::-1]]), y=np.concatenate([high, low[::-1]]), fill="toself",
                                 fillcolor=colour, opacity=0.2, line={"width": 0}, hoverinfo="skip",
                                 name=f"{name}: {_level(sub)}", legendgroup=name, showlegend=show), **where)
    fig.add_trace(go.Scatter(x=x, y=sub[column], mode="lines+markers", line={"color": colour}, name=name,
                             legendgroup=name, showlegend=show,
                             hovertemplate="c = %{x}<br>%{y:.4g}<br>" + _level(sub) + " [%{customdata[0]:.4g}, "
                             "%{customdata[1]:.4g}]<extra></extra>", customdata=np.stack([low, high], 1)), **where)


def coefficient_title(t: pd.DataFrame) -> str:
    """The coefficient axis: what a coefficient multiplies (scale.py)."""
    mode = str(t["mode"].iloc[0])
    if "residual_norm" in t and np.isfinite(float(t["residual_norm"].iloc[0])):
        return f"coefficient c ({mode}; x R = {float(t['residual_norm'].iloc[0]):.3g}, the site's mean activation norm)"
    c, written = t["coefficient"].abs().to_numpy(float), t.get("written_norm")
    if written is not None and "direction_norm" in t and (c > 0).any():
        unit = float(written.to_numpy(float)[c > 0][0] / c[c > 0][0])
        if np.isclose(unit, 1.0) and not np.isclose(float(t["direction_norm"].iloc[0]), 1.0):
            return f"coefficient c ({mode}; x the direction's unit vector)"
        if np.isfinite(unit):
            return f"coefficient c ({mode}; x the direction, norm {float(t['direction_norm'].iloc[0]):.3g})"
    return f"coefficient c ({mode})"


def dose_response(result: Any) -> Any:
    import plotly.graph_objects as go

    t = result.table
    metric = str(t["metric"].iloc[0])
    fig = go.Figure()
    if "negligible_share" in t:  # the band an effect too small to matter stays in (docs/pages.md)
        band = float(t["negligible_share"].iloc[0]) * abs(float(t["metric_unsteered"].iloc[0]))
        fig.add_hrect(y0=-band, y1=band, fillcolor="#bbb", opacity=0.25, line_width=0,
                      annotation_text=f"negligible: within {float(t['negligible_share'].iloc[0]):.0%} of the "
                      f"unsteered {metric}", annotation_position="top left")
    for which in ("direction", "random"):
        _band(fig, t[t["direction"] == which], "effect", COLOURS[which], NAMES[which])
    fig.add_hline(y=0, line={"color": "#999", "dash": "dot"})
    fig.update_layout(title=f"effect on the {metric} against the coefficient (steered - unsteered, "
                      f"{int(t['n_prompts'].iloc[0])} prompts)",
                      xaxis_title=coefficient_title(t), yaxis_title=f"change in {metric}")
    return fig


def side_effects_vs_effect(result: Any) -> Any:
    import plotly.graph_objects as go

    t = result.table
    fig = go.Figure()
    for which in ("direction", "random"):
        sub = t[t["direction"] == which]
        fig.add_trace(go.Scatter(
            x=sub["kl"], y=sub["effect"], mode="markers+text" if which == "direction" else "markers",
            text=[f"c={c:g}" for c in sub["coefficient"]], textposition="middle right",
            marker={"color": COLOURS[which], "size": 9},
            name=f"{NAMES[which]} (bars: {_level(t)})", **both_interval_bars(sub, "kl", "effect", "condition"),
            hovertemplate="KL %{x:.4g} nats<br>effect %{y:.4g}<extra>%{text}</extra>"))
    fig.update_layout(title="effect on the task against the side effect on held-out prompts",
                      xaxis_title="KL(steered || unsteered) on held-out prompts, nats per position",
                      yaxis_title=f"change in {t['metric'].iloc[0]}")
    kl = t["kl"].to_numpy(float)
    if np.isfinite(kl).all() and (kl > 0).all() and kl.max() > 20 * kl.min():
        fig.update_xaxes(type="log", title_text="KL(steered || unsteered) on held-out prompts, nats per position "
                         "(log scale)")
    return fig


def side_effects_vs_coefficient(result: Any) -> Any:
    from plotly.subplots import make_subplots

    t = result.table
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(steered || unsteered), nats per position",
                                                        "change in next-token loss, nats"))
    for i, which in enumerate(("direction", "random")):
        sub = t[t["direction"] == which]
        _band(fig, sub, "kl", COLOURS[which], NAMES[which], 1, 1)
        _band(fig, sub, "loss_change", COLOURS[which], NAMES[which], 1, 2, show=False)
    fig.update_layout(title=f"side effects on {int(t['n_held_out'].iloc[0])} held-out prompts")
    fig.update_xaxes(title_text=coefficient_title(t))
    return fig


def task_scores(result: Any) -> Any:
    import plotly.graph_objects as go

    t = result.table
    tasks = [c[: -len("_change")] for c in t.columns if c.endswith("_change") and c != "loss_change"]
    fig = go.Figure()
    for k, task in enumerate(tasks):
        colour = TASK_COLOURS[k % len(TASK_COLOURS)]
        for which, dash in (("direction", "solid"), ("random", "dot")):
            sub = t[t["direction"] == which].sort_values("coefficient")
            fig.add_trace(go.Scatter(x=sub["coefficient"], y=sub[f"{task}_change"], mode="lines+markers",
                                     line={"color": colour, "dash": dash},
                                     **interval_bars(sub, f"{task}_change", "condition"),
                                     name=f"{task} ({'direction' if which == 'direction' else 'random'}; bars: "
                                     f"{_level(t)})"))
    fig.add_hline(y=0, line={"color": "#999", "dash": "dot"})
    fig.update_layout(title="change in each built-in task's score (steered - unsteered)", xaxis_title=coefficient_title(t),
                      yaxis_title="change in the task's score")
    return fig


def continuations_table(frame: pd.DataFrame) -> Any:
    """One line per prompt and condition (the wide table is continuations.csv)."""
    import plotly.graph_objects as go

    conditions = [c for c in frame.columns if c != "prompt"]
    long = pd.DataFrame([{"prompt": row["prompt"] if j == 0 else "", "steering": c, "continuation": row[c]}
                         for _, row in frame.iterrows() for j, c in enumerate(conditions)])
    fig = go.Figure(go.Table(columnwidth=[3, 1, 2], header={"values": list(long.columns), "align": "left"},
                             cells={"values": [long[c].astype(str).tolist() for c in long.columns], "align": "left"}))
    fig.update_layout(title="continuations, unsteered and steered side by side", height=140 + 28 * len(long))
    return fig


def steering_figures(result: Any) -> list[tuple[str, Any]]:
    t = result.table
    if not len(t):
        return []
    figs = [("dose-response", dose_response(result))]
    if "kl" in t:
        figs += [("side effects against effect", side_effects_vs_effect(result)),
                 ("side effects against the coefficient", side_effects_vs_coefficient(result))]
    if any(c.endswith("_change") and c != "loss_change" for c in t.columns):
        figs.append(("task scores", task_scores(result)))
    frame = result.extra.get("continuations")
    if frame is not None and len(frame):
        figs.append(("continuations", continuations_table(frame)))
    return figs
