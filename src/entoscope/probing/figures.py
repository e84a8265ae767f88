"""Figures of a probing Result: held-out score and selectivity by layer (and position), control and
chance lines, error bars; the causal check against its random baseline.

Error bars: the bootstrap interval over the held-out prompts (`<column>_ci_low/high`, see
intervals.py), named on the value axis. Without intervals (stats.n_boot = 0), and said so: the sample
standard deviation over folds (k-fold); a holdout split has no spread over folds, so its accuracy
gets the binomial standard error sqrt(p (1 - p) / n_test) instead (R^2: none). The causal check's bars:
the interval over prompts of the change (causal.py), else its standard error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..results.figures import interval_note, metric_unit, noted
from ..stats import error_arrays
from ..stats.columns import hover_value, interval_bars, level_text

SERIES_AXES = ("position", "head", "kv_head", "neuron")
MAX_LINES = 8
SCALE_TITLES = {"accuracy": "held-out accuracy<br>(share correct)", "r2": "held-out R²<br>(1 = perfect)"}
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
        return interval, interval_note(level_text(t), "held-out prompts")
    std = t.get(f"{column}_std")
    if std is not None and np.isfinite(std.to_numpy(dtype=float)).all():
        return _symmetric(std.to_numpy(dtype=float)), "error bars: std over folds (no interval: stats.n_boot 0)"
    if column.endswith("accuracy") and "n_test" in t:
        p = t[column].to_numpy(dtype=float)
        return _symmetric(np.sqrt(p * (1 - p) / t["n_test"].to_numpy(dtype=float))), \
            "error bars: binomial s.e. (no interval: stats.n_boot 0)"
    if column == "selectivity" and "test_accuracy" in t and "n_test" in t:
        n = t["n_test"].to_numpy(dtype=float)
        p, q = t["test_accuracy"].to_numpy(dtype=float), t["control_test_accuracy"].to_numpy(dtype=float)
        return _symmetric(np.sqrt(p * (1 - p) / n + q * (1 - q) / n)), \
            "error bars: binomial s.e. (no interval: stats.n_boot 0)"
    return None, "no spread (one split)"


def _bars(t: pd.DataFrame, column: str) -> dict[str, Any]:
    """Trace arguments: the table's interval of `column` (with the rows' sites), else the fallback spread."""
    tagged = interval_bars(t, column, "site")
    if tagged:
        return tagged
    err, _ = error_bars(t, column)
    return {"error_y": err} if err is not None else {}


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
        fig.add_trace(go.Scatter(x=sub[x], y=sub[column], mode="lines+markers", name=name or "probe",
                                 line={"color": color}, **_bars(sub, column)))
        if control is not None and control in sub:
            fig.add_trace(go.Scatter(x=sub[x], y=sub[control], mode="lines+markers",
                                     name=f"{name + ' ' if name else ''}control", line={"color": color, "dash": "dash"},
                                     marker={"symbol": "circle-open"}, **_bars(sub, control)))
    if chance is not None and np.isfinite(chance):
        fig.add_hline(y=chance, line_dash="dot", line_color="gray", annotation_text="chance (majority class)")
    fig.update_layout(xaxis_title=x, yaxis_title=noted(ylabel, error_bars(t, column)[1]), height=380,
                      legend={"orientation": "h"})
    if x == "layer":
        fig.update_xaxes(dtick=1)
    return fig


def _heatmap(t: pd.DataFrame, series: str, column: str, title: str) -> Any:
    import plotly.graph_objects as go

    grid = t.pivot_table(index="layer", columns=series, values=column, aggfunc="first")
    scale = {"colorscale": "RdBu", "zmid": 0} if column == "selectivity" else {"colorscale": "Viridis"}
    hover = t.assign(_h=[f"{r['site']}<br>{hover_value(r, column)}" for _, r in t.iterrows()]).pivot_table(
        index="layer", columns=series, values="_h", aggfunc="first").reindex(index=grid.index, columns=grid.columns)
    # the layers probed as categories: one equal row each, labelled once (a few layers spread over 30 would
    # otherwise get uneven rows on an axis ticked at every layer, its labels piled on each other)
    fig = go.Figure(go.Heatmap(z=grid.values, x=[str(c) for c in grid.columns], y=[str(L) for L in grid.index],
                               text=hover.values, hovertemplate="%{text}<extra></extra>",
                               texttemplate="%{z:.2f}", colorbar={"title": title}, **scale))
    fig.update_layout(xaxis_title=series, yaxis_title="layer", height=120 + 36 * len(grid))
    fig.update_yaxes(type="category")
    return fig


def _causal(t: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    sub = t[t["metric_change"].notna()]
    fig = go.Figure(go.Bar(x=sub["site"], y=sub["metric_change"], name="probe direction removed",
                           **_causal_bars(sub, "metric_change")))
    if "random_metric_change" in sub:
        fig.add_trace(go.Bar(x=sub["site"], y=sub["random_metric_change"], name="random direction removed",
                             **_causal_bars(sub, "random_metric_change")))
    metric = sub["metric"].iloc[0] if "metric" in sub else "metric"
    what = interval_note(level_text(t)) if error_arrays(sub, "metric_change") is not None else \
        "error bars: s.e. over prompts (no interval: stats.n_boot 0)"
    fig.update_layout(barmode="group", height=360,
                      yaxis_title=noted(f"change in {metric}, ablated - clean ({metric_unit(metric)})", what))
    return fig


def _causal_bars(t: pd.DataFrame, column: str) -> dict[str, Any]:
    tagged = interval_bars(t, column, "site")
    return tagged or {"error_y": {"type": "data", "array": t[f"{column}_se"].to_numpy(dtype=float)}}


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
    figs = []
    lines, where = t, ""
    if series is not None and t[series].nunique() > MAX_LINES and x == "layer":
        # too many lines: draw the one with the highest selectivity (held-out score without a control)
        key = "selectivity" if "selectivity" in t else column
        best = t.loc[t[key].astype(float).idxmax(), series]
        lines, where, series_in_lines = t[t[series] == best], f" at {series} {best}", None
    else:
        series_in_lines = series
    figs.append((f"held-out {primary} by {x}{where} (dashed: the control task)",
                 _lines(lines, x, series_in_lines, column, control, chance, f"held-out {primary}")))
    if "selectivity" in t:
        figs.append((f"selectivity = held-out {primary} - control's, by {x}{where}",
                     _lines(lines, x, series_in_lines, "selectivity", None, None, "selectivity")))
    if series is not None and x == "layer":
        figs.append((f"held-out {primary} by layer and {series}", _heatmap(t, series, column, SCALE_TITLES[primary])))
        if "selectivity" in t:
            figs.append((f"selectivity by layer and {series}",
                         _heatmap(t, series, "selectivity", "selectivity<br>(score - control)")))
    if "metric_change" in t and t["metric_change"].notna().any():
        figs.append(("causal check: the task metric with the probe direction projected out, against a random "
                     "direction's", _causal(t)))
    return figs
