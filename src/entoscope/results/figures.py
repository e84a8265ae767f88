"""What every figure on a page gets, whichever operation drew it: a height that fits its rows (40 px a row
up to 40 rows, 16 px a row past that), integer ticks on layer / head / position axes, values written in a
heatmap's cells only while each cell is large enough to read it (CELL_TEXT_PX wide, CELL_TEXT_ROW_PX
tall, MAX_CELL_TEXT cells at most; otherwise the value stays in the hover alone), a diverging colour
scale centred at 0 for signed heatmaps, colour bars of a readable size with a title, and legends placed
where they never cover data or axis titles.
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
MAX_CELL_TEXT = 600  # at most this many cells of a heatmap hold text (30 layers x 15 positions is 450)
CELL_TEXT_PX, CELL_TEXT_ROW_PX = 40, 20  # and each cell at least this wide and tall (about "-0.12" at 12 px)
PAGE_PLOT_PX = 1000  # about the plot area's width on a page (1280 px window, less margins and colour bar)


def polish(fig: Any) -> Any:
    """Apply the house figure rules to a plotly figure in place (and return it)."""
    _integer_ticks(fig)
    rows = 0
    for trace in fig.data:
        if trace.type == "heatmap" and trace.z is not None:
            z = np.asarray(trace.z, dtype=float)
            rows = max(rows, z.shape[0] if z.ndim == 2 else 1)
            _colour_scale(trace, z)
            trace.colorbar.thickness = 14
            trace.colorbar.len = 1.0
            if not (trace.colorbar.title and trace.colorbar.title.text):
                trace.colorbar.title.text = trace.name or "value"
    height = fig.layout.height or 0
    if rows:
        height = max(height, 140 + (ROW_PX if rows <= MANY_ROWS else SMALL_ROW_PX) * rows)
    fig.update_layout(height=max(height, MIN_HEIGHT))
    panels = len({getattr(t, "xaxis", None) or "x" for t in fig.data})
    for trace in fig.data:
        if trace.type == "heatmap" and trace.z is not None:
            _cell_text(trace, np.asarray(trace.z, dtype=float), fig.layout.height, panels)
    _legend(fig)
    return fig


def _cell_text(trace: Any, z: np.ndarray, height: int, panels: int) -> None:
    """Text in a heatmap's cells only where a cell is large enough to read it: at least CELL_TEXT_PX wide
    (the plot's width shared by every panel's columns) and CELL_TEXT_ROW_PX tall, and at most MAX_CELL_TEXT
    cells; otherwise the text goes and the value stays in the hover (a hover without a template shows z;
    the operations' own hover texts hold the value)."""
    if not trace.texttemplate or z.ndim != 2:
        return
    rows, columns = z.shape
    wide = PAGE_PLOT_PX / max(1, panels) / max(1, columns)
    tall = (height - 140) / max(1, rows)
    if z.size > MAX_CELL_TEXT or wide < CELL_TEXT_PX or tall < CELL_TEXT_ROW_PX:
        trace.texttemplate = None


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
            distinct = sorted({int(v) for v in values})
            if len(distinct) <= 30 and distinct != list(range(distinct[0], distinct[-1] + 1)):
                axis.update(tickmode="array", tickvals=distinct, tickformat="d")  # a few spread layers: ticked alone
            else:
                axis.update(tickmode="linear", dtick=1 if len(distinct) <= 30 else None, tickformat="d")


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
