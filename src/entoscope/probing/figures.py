"""Figures of a probing Result: held-out score and selectivity by layer (and position), control and
chance lines, error bars; the causal check against its random baseline.

Error bars: the bootstrap interval over the held-out prompts (`<column>_ci_low/high`, see
intervals.py). Without intervals (stats.n_boot = 0): the sample standard deviation over folds
(k-fold); a holdout split has no spread over folds, so its accuracy gets the binomial standard
error sqrt(p (1 - p) / n_test) instead (R^2: none).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..stats import error_arrays

SERIES_AXES = ("position", "head", "kv_head", "neuron")
MAX_LINES = 8
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _primary(t: pd.DataFrame) -> str:
    return "accuracy" if "test_accuracy" in t else "r2"


def _x_axis(t: pd.DataFrame) -> str:
    return "layer" if "layer" in t and t["layer"].notna().all() and t["layer"].nunique() > 1 else "site"


def _series(t: pd.DataFrame) -> str | None:
    for ax in SERIES_AXES:
        if ax in t and t[ax].nunique() > 1:
            return ax
    return None


def error_bars(t: pd.DataFrame, column: str) -> tuple[dict[str, Any] | None, str]:
    """(plotly error bars per row, what they are) for a test/control/selectivity column."""
    interval = error_arrays(t, column)
    if interval is not None:
        return interval, f"{round(100 * float(t['ci_level'].iloc[0]))}% bootstrap interval over held-out prompts"
    std = t.get(f"{column}_std")
    if std is not None and np.isfinite(std.to_numpy(dtype=float)).all():
        return _symmetric(std.to_numpy(dtype=float)), "std over folds"
    if column.endswith("accuracy") and "n_test" in t:
        p = t[column].to_numpy(dtype=float)
        return _symmetric(np.sqrt(p * (1 - p) / t["n_test"].to_numpy(dtype=float))), "binomial s.e."
    if column == "selectivity" and "test_accuracy" in t and "n_test" in t:
        n = t["n_test"].to_numpy(dtype=float)
        p, q = t["test_accuracy"].to_numpy(dtype=float), t["control_test_accuracy"].to_numpy(dtype=float)
        return _symmetric(np.sqrt(p * (1 - p) / n + q * (1 - q) / n)), "binomial s.e."
    return None, "no spread (one split)"


def _symmetric(err: np.ndarray) -> dict[str, Any]:
    return {"type": "data", "array": err, "visible": True}


def _groups(t: pd.DataFrame, series: str | None) -> list[tuple[str, pd.DataFrame]]:
    if series is None:
        return [("", t)]
    return [(f"{series} {v}", sub) for v, sub in t.groupby(series, sort=True)]


def _lines(t: pd.DataFrame, x: str, series: str | None, column: str, control: str | None, chance: float | None,
           ylabel: str) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, (name, sub) in enumerate(_groups(t, series)):
        color = COLORS[i % len(COLORS)]
        err, _ = error_bars(sub, column)
        fig.add_trace(go.Scatter(x=sub[x], y=sub[column], mode="lines+markers", name=name or "probe",
                                 line={"color": color}, error_y=err))
        if control is not None and control in sub:
            cerr, _ = error_bars(sub, control)
            fig.add_trace(go.Scatter(x=sub[x], y=sub[control], mode="lines+markers",
                                     name=f"{name + ' ' if name else ''}control", line={"color": color, "dash": "dash"},
                                     marker={"symbol": "circle-open"}, error_y=cerr))
    if chance is not None and np.isfinite(chance):
        fig.add_hline(y=chance, line_dash="dot", line_color="gray", annotation_text="chance (majority class)")
    fig.update_layout(xaxis_title=x, yaxis_title=ylabel, height=380, legend={"orientation": "h"})
    if x == "layer":
        fig.update_xaxes(dtick=1)
    return fig


def _heatmap(t: pd.DataFrame, series: str, column: str, title: str) -> Any:
    import plotly.graph_objects as go

    grid = t.pivot_table(index="layer", columns=series, values=column, aggfunc="first")
    scale = {"colorscale": "RdBu", "zmid": 0} if column == "selectivity" else {"colorscale": "Viridis"}
    fig = go.Figure(go.Heatmap(z=grid.values, x=[str(c) for c in grid.columns], y=list(grid.index),
                               texttemplate="%{z:.2f}", colorbar={"title": title}, **scale))
    fig.update_layout(xaxis_title=series, yaxis_title="layer", height=120 + 36 * len(grid))
    return fig


def _causal(t: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    sub = t[t["metric_change"].notna()]
    fig = go.Figure(go.Bar(x=sub["site"], y=sub["metric_change"], name="probe direction removed",
                           error_y={"type": "data", "array": sub["metric_change_se"].to_numpy(dtype=float)}))
    if "random_metric_change" in sub:
        fig.add_trace(go.Bar(x=sub["site"], y=sub["random_metric_change"], name="random direction removed",
                             error_y={"type": "data", "array": sub["random_metric_change_se"].to_numpy(dtype=float)}))
    metric = sub["metric"].iloc[0] if "metric" in sub else "metric"
    fig.update_layout(barmode="group", yaxis_title=f"change in {metric} (ablated - clean)", height=340)
    return fig


def probing_figures(result: Any) -> list[tuple[str, Any]]:
    t = result.table
    primary = _primary(t)
    column = f"test_{primary}"
    x = _x_axis(t)
    series = _series(t)
    if x != "layer" and series is not None:  # one layer: the other axis (position, head, ...) is the x axis
        x, series = series, None
    control = f"control_{column}" if f"control_{column}" in t else None
    chance = float(t["chance_accuracy"].mean()) if primary == "accuracy" and "chance_accuracy" in t else None
    _, what = error_bars(t, column)
    figs = []
    lines, where = t, ""
    if series is not None and t[series].nunique() > MAX_LINES and x == "layer":
        # too many lines: draw the one with the highest selectivity (held-out score without a control)
        key = "selectivity" if "selectivity" in t else column
        best = t.loc[t[key].astype(float).idxmax(), series]
        lines, where, series_in_lines = t[t[series] == best], f" at {series} {best}", None
    else:
        series_in_lines = series
    figs.append((f"held-out {primary} by {x}{where} (dashed: control task; error bars: {what})",
                 _lines(lines, x, series_in_lines, column, control, chance, f"held-out {primary}")))
    if "selectivity" in t:
        _, swhat = error_bars(t, "selectivity")
        figs.append((f"selectivity = held-out {primary} - control's, by {x}{where} (error bars: {swhat})",
                     _lines(lines, x, series_in_lines, "selectivity", None, None, "selectivity")))
    if series is not None and x == "layer":
        figs.append((f"held-out {primary} by layer and {series}", _heatmap(t, series, column, primary)))
        if "selectivity" in t:
            figs.append((f"selectivity by layer and {series}", _heatmap(t, series, "selectivity", "selectivity")))
    if "metric_change" in t and t["metric_change"].notna().any():
        figs.append(("causal check: the task metric with the probe direction projected out (vs a random "
                     "direction; error bars: s.e. over prompts)", _causal(t)))
    return figs
