"""What every figure on a page gets, whichever operation drew it: a height that fits its rows (40 px a row
up to 40 rows, 16 px a row past that), integer ticks on layer / head / position axes, values written in a
heatmap's cells only while it has at most MAX_CELL_TEXT cells (past that the cells are too small to read
and the value stays in the hover alone; words such as a lens's tokens up to MAX_WORD_CELLS), x tick labels turned when they would not fit side by side, a diverging colour scale centred at 0 for signed heatmaps, colour
bars of a readable size with a title, and legends placed where they never cover data or axis titles.
And the words every figure uses for the same things: what its error bars are (`interval_note`, always
the table's interval at the run's level) and the unit of a metric (`metric_unit`)."""

from __future__ import annotations

from typing import Any

import numpy as np

INTEGER_AXES = ("layer", "head", "kv_head", "position", "step", "prompt")
METRIC_UNITS = {"logit_diff": "logits", "logit": "logits", "prob": "probability", "prob_diff": "probability",
                "logprob": "nats", "kl": "nats", "top1": "share of prompts"}


def interval_note(level: str, over: str = "prompts", marks: str = "error bars") -> str:
    """'error bars: 95% interval over prompts': what a figure's error bars (or bands) are."""
    return f"{marks}: {level} interval over {over}"


def noted(title: str, note: str) -> str:
    """An axis or figure title with a second, smaller line (the interval note)."""
    return f"{title}<br><sup>{note}</sup>" if note else title


def metric_unit(metric: str, comparison: str | None = None) -> str:
    """The unit of a metric's values (a normalised effect: its scale, 1 = the clean run, 0 = the corrupt run)."""
    if comparison in ("normalized", "normalised"):
        return "1 = clean, 0 = corrupt"
    return METRIC_UNITS.get(metric, "metric units")
ROW_PX, MIN_HEIGHT = 40, 300
MANY_ROWS, SMALL_ROW_PX = 40, 16  # past MANY_ROWS rows, SMALL_ROW_PX a row (a 270-row grid stays one screenful-ish)
MAX_CELL_TEXT = 200  # cells of a heatmap whose values are written in the cells (30 layers x 9 heads is past it)
MAX_WORD_CELLS = 600  # cells of a heatmap that writes words (tokens) in its cells, past MAX_CELL_TEXT in 10 px
PAGE_PLOT_PX = 1000  # about the plot area's width on a page (1280 px window, less margins and colour bar)
CHAR_PX = 7  # about one character of a 12 px tick label


def polish(fig: Any) -> Any:
    """Apply the house figure rules to a plotly figure in place (and return it)."""
    _integer_ticks(fig)
    rows = 0
    for trace in fig.data:
        if trace.type == "heatmap" and trace.z is not None:
            z = np.asarray(trace.z, dtype=float)
            rows = max(rows, z.shape[0] if z.ndim == 2 else 1)
            _colour_scale(trace, z)
            _cell_text(trace, z)
            trace.colorbar.thickness = 14
            trace.colorbar.len = 1.0
            if not (trace.colorbar.title and trace.colorbar.title.text):
                trace.colorbar.title.text = trace.name or "value"
    height = fig.layout.height or 0
    if rows:
        height = max(height, 140 + (ROW_PX if rows <= MANY_ROWS else SMALL_ROW_PX) * rows)
    fig.update_layout(height=max(height, MIN_HEIGHT))
    _turned_labels(fig)
    _legend(fig)
    return fig


def _cell_text(trace: Any, z: np.ndarray) -> None:
    """A heatmap past MAX_CELL_TEXT cells keeps its values in the hover only (a hover without a template
    shows z; the operations' own hover texts hold the value). Words in the cells (a lens's top tokens: what
    the figure is read for) stay up to MAX_WORD_CELLS cells, in a smaller font past MAX_CELL_TEXT."""
    template = trace.texttemplate or ""
    if z.size <= MAX_CELL_TEXT or not template:
        return
    if "%{z" in template or z.size > MAX_WORD_CELLS:
        trace.texttemplate = None
    else:
        trace.textfont.size = 10


def _turned_labels(fig: Any) -> None:
    """Category x axes whose labels would not fit side by side across the plot get them turned 45 degrees
    (plotly would turn them too, but only after drawing; a fixed angle keeps the bottom margin for them)."""
    layout = fig.layout
    for name in [k for k in layout if k.startswith("xaxis")]:
        ref = "x" + name[5:]
        values: list[Any] = []
        for t in fig.data:
            if (getattr(t, "xaxis", None) or "x") == ref and getattr(t, "x", None) is not None:
                values += list(np.asarray(t.x, dtype=object).ravel())
        panels = len({getattr(t, "xaxis", None) or "x" for t in fig.data})
        if not values or all(_is_number(v) for v in values) or layout[name].tickangle is not None:
            continue
        labels = {str(v) for v in values}
        room = PAGE_PLOT_PX / max(1, panels) / len(labels)
        if max(map(len, labels)) * CHAR_PX > room:
            layout[name].update(tickangle=-45, automargin=True)


def _integer_ticks(fig: Any) -> None:
    layout = fig.layout
    for name in [k for k in layout if k.startswith(("xaxis", "yaxis"))]:
        axis = layout[name]
        title = (axis.title.text or "").lower() if axis.title else ""
        if not any(title.startswith(w) or f" {w}" in title for w in INTEGER_AXES):
            continue
        letter, ref = name[0], name[0] + name[5:]  # "xaxis2" -> ("x", "x2")
        values: list[Any] = []
        for t in fig.data:
            if (getattr(t, f"{letter}axis", None) or letter) == ref and getattr(t, letter, None) is not None:
                values += [v for v in np.asarray(getattr(t, letter), dtype=object).ravel() if _is_number(v)]
        if values and all(float(v).is_integer() for v in values):
            axis.update(tickmode="linear", dtick=1 if len(set(values)) <= 30 else None, tickformat="d")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v)


def _colour_scale(trace: Any, z: np.ndarray) -> None:
    """Signed data (both signs) get a diverging scale centred at 0, symmetric, unless the trace chose one."""
    finite = z[np.isfinite(z)]
    if not finite.size or trace.zmid is not None or trace.zmin is not None:
        return
    if finite.min() < 0 < finite.max():
        bound = float(np.abs(finite).max())
        trace.update(colorscale="RdBu", zmid=0, zmin=-bound, zmax=bound)


def _legend(fig: Any) -> None:
    """Legends go above the plot area, in a row, so they cover neither data nor axis titles."""
    if not any(getattr(t, "showlegend", None) is not False and getattr(t, "name", None) for t in fig.data):
        return
    titled = bool(fig.layout.title and fig.layout.title.text)
    fig.update_layout(legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0})
    top = 90 if titled else 60
    fig.update_layout(margin={"t": max(top, (fig.layout.margin.t or 0))})
    if titled:
        fig.update_layout(title={"y": 0.98, "yanchor": "top"})
