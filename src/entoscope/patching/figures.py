"""Figures of a patching result: the site heatmap (layer x position with the first prompt's tokens on
the axis, or layer x head), and the per-prompt drill-down (prompts x sites)."""

from __future__ import annotations

import re

from typing import Any

import numpy as np

from .. import naming
from ..results.figures import interval_note, metric_unit, noted
from ..results.result import Result
from ..stats.columns import hover_value, interval_bars, level_text

MAX_DRILL_SITES = 400
MAX_DRILL_PROMPTS = 200  # rows of the per-prompt heatmap (the first prompts; the files have every one)
TOP_FEATURE_SITES = 40  # feature sites shown (largest |value|): a dictionary has hundreds per position


def _colour(values: np.ndarray) -> dict[str, Any]:
    finite = values[np.isfinite(values)]
    bound = float(np.abs(finite).max()) if finite.size else 1.0
    return {"colorscale": "RdBu", "zmid": 0, "zmin": -bound or -1, "zmax": bound or 1}


def _from_end(label: Any) -> int | None:
    """The token index from the end (-1, -2, ...) of a label END, END-1, ...; None for anything else."""
    m = re.fullmatch(r"END(?:-(\d+))?", str(label))
    return None if m is None else -1 - int(m.group(1) or 0)


def _position_labels(result: Result, positions: list[Any]) -> list[str]:
    """Axis labels: a token index or a position from the end (END, END-1) shows the first prompt's token
    there; a role is its name (each prompt has its own token there)."""
    tokens = result.extra.get("first_tokens") or []
    labels = []
    for p in positions:
        index = _from_end(p)
        if index is None:
            try:
                index = int(p)
            except (TypeError, ValueError):
                labels.append(str(p))
                continue
        tok = tokens[index] if tokens and -len(tokens) <= index < len(tokens) else ""
        labels.append(f"{p}: {tok!r}" if tok else str(p))
    return labels


def _position_title(positions: Any) -> str:
    shown = [p for p in positions if str(p).isdigit() or _from_end(p) is not None]
    if not shown:
        return "position: the token of each role (IO, S1, ...) in each prompt"
    what = "END-k: k tokens before each prompt's last" if any(_from_end(p) is not None for p in shown) else \
        "numbers: token indices"
    if len(shown) < len(positions):
        return f"position ({what}, with the first prompt's base-run token; names: each prompt's token of that role)"
    return f"position ({what}; the first prompt's base-run token shown)"


def _hover(t: Any, index: str, columns: str) -> Any:
    """Hover text per cell: its name, the value with its interval, its q, and the influence of its most
    influential prompt."""
    def text(r: Any) -> str:
        out = f"{r['site']}<br>{hover_value(r, 'value')}"
        if "value_q" in r and np.isfinite(r["value_q"]):
            out += f"<br>q = {r['value_q']:.2g}" + (" (significant)" if r.get("significant") else "")
        if "value_influence" in r and np.isfinite(r["value_influence"]):
            out += f"<br>one prompt (#{int(r['value_influential_prompt'])}) moves it by {r['value_influence']:.2g}"
        if r.get("value_fragile"):
            out += " (fragile)"
        return out + f"<br>n = {int(r['n_prompts'])}"
    frame = t.assign(_hover=t.apply(text, axis=1))
    return frame.pivot_table(index=index, columns=columns, values="_hover", aggfunc="first", sort=False)


def _unit(what: str) -> str:
    comparison, _, metric = what.partition(" ")
    return metric_unit(metric, comparison)


def patching_figures(result: Result) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = result.table
    what = result.extra.get("value_label", "value")
    figs: list[tuple[str, Any]] = []
    has = {c for c in ("layer", "position", "head", "kv_head", "neuron", "feature") if c in t and t[c].notna().all()}
    level = level_text(t)
    scale = f"{what}<br>({_unit(what)})"
    if "feature" in has:
        top = t.reindex(t["value"].abs().sort_values(ascending=False).index[:TOP_FEATURE_SITES])
        hover = [f"{r['site']}<br>{hover_value(r, 'value')}" + (f"<br>q = {r['value_q']:.2g}" if "value_q" in r else "")
                 for _, r in top.iterrows()]
        fig = go.Figure(go.Bar(x=top["site"].astype(str), y=top["value"], text=hover, textposition="none",
                               hovertemplate="%{text}<extra></extra>", **interval_bars(top, "value", "site")))
        fig.update_layout(xaxis_title="feature site (naming: docs/pages.md)",
                          yaxis_title=noted(f"{what} ({_unit(what)})", interval_note(level)), height=380)
        figs.append((f"{what}: the {len(top)} feature sites of largest |value| (of {len(t)})", fig))
    elif {"layer", "position"} <= has and len(has) == 2:
        grid = t.pivot_table(index="layer", columns="position", values="value", aggfunc="first", sort=False)
        hover = _hover(t, "layer", "position").reindex(index=grid.index, columns=grid.columns)
        fig = go.Figure(go.Heatmap(z=grid.values, x=_position_labels(result, list(grid.columns)), y=list(grid.index),
                                   texttemplate="%{z:.2f}", text=hover.values, hovertemplate="%{text}<extra></extra>",
                                   **_colour(grid.values), colorbar={"title": scale}))
        fig.update_layout(xaxis_title=_position_title(grid.columns), yaxis_title="layer",
                          height=160 + 32 * len(grid))
        figs.append((f"{what} by layer and position (hover: the {level} interval over prompts and q)", fig))
    elif "layer" in has and ("head" in has or "kv_head" in has) and len(has) == 2:
        head = "head" if "head" in has else "kv_head"
        grid = t.pivot_table(index="layer", columns=head, values="value", aggfunc="first")
        hover = _hover(t, "layer", head).reindex(index=grid.index, columns=grid.columns)
        fig = go.Figure(go.Heatmap(z=grid.values, x=[f"h{int(h)}" for h in grid.columns], y=list(grid.index),
                                   texttemplate="%{z:.2f}", text=hover.values, hovertemplate="%{text}<extra></extra>",
                                   **_colour(grid.values), colorbar={"title": scale}))
        fig.update_layout(xaxis_title=head.replace("_", "/"), yaxis_title="layer", height=160 + 32 * len(grid))
        figs.append((f"{what} by layer and head (hover: the {level} interval over prompts and q)", fig))
    elif {"layer", "head", "position"} <= has:
        rows = t.assign(lh=[naming.head(L, h) for L, h in zip(t["layer"], t["head"])])
        grid = rows.pivot_table(index="lh", columns="position", values="value", aggfunc="first", sort=False)
        hover = _hover(rows, "lh", "position").reindex(index=grid.index, columns=grid.columns)
        fig = go.Figure(go.Heatmap(z=grid.values, x=_position_labels(result, list(grid.columns)), y=list(grid.index),
                                   text=hover.values, hovertemplate="%{text}<extra></extra>",
                                   **_colour(grid.values), colorbar={"title": scale}))
        fig.update_layout(xaxis_title="position", yaxis_title="head", height=160 + 14 * len(grid))
        figs.append((f"{what} by head and position (hover: the {level} interval over prompts and q)", fig))
    else:
        fig = go.Figure(go.Bar(x=t["site"].astype(str), y=t["value"], text=[f"{r['site']}<br>{hover_value(r, 'value')}"
                                                                            for _, r in t.iterrows()],
                               textposition="none", hovertemplate="%{text}<extra></extra>",
                               **interval_bars(t, "value", "site")))
        fig.update_layout(xaxis_title="site", yaxis_title=noted(f"{what} ({_unit(what)})", interval_note(level)),
                          height=360)
        figs.append((f"{what} by site", fig))
    pp = result.per_prompt_head(MAX_DRILL_PROMPTS)
    if pp is not None and len(pp) and t["site"].nunique() <= MAX_DRILL_SITES:
        column = result.extra.get("per_prompt_column", "difference")
        grid = pp.pivot_table(index="example", columns="site", values=column, aggfunc="first", sort=False,
                              dropna=False)  # a degenerate pair keeps its (blank) row
        grid = grid[[s for s in t["site"] if s in grid.columns]]
        comparison, _, metric = what.partition(" ")
        fig = go.Figure(go.Heatmap(z=grid.values, x=list(grid.columns), y=[f"#{i}" for i in grid.index],
                                   **_colour(grid.values),
                                   colorbar={"title": f"{column}<br>({metric_unit(metric, column)})"}))
        fig.update_layout(xaxis_title="site", yaxis_title="prompt", height=160 + 14 * len(grid))
        n = int(t["n_prompts"].iloc[0]) if "n_prompts" in t else len(grid)
        which = "" if len(grid) >= n else f"; the first {len(grid)} of {n} prompts"
        blank = " (blank: a degenerate pair, see the glossary" + which + ")" if column == "normalized" else \
            (f" ({which[2:]})" if which else "")
        figs.append((f"per prompt: {column}{blank}", fig))
    return figs


def degenerate_note(n_degenerate: int, n: int, share: float) -> str:
    """The degenerate pairs in the glossary's words (a run's warning; '' when there are none)."""
    if not n_degenerate:
        return ""
    return (f"{n_degenerate} of {n} pairs are degenerate: their clean and corrupt metrics differ by under "
            f"{share:.0%} of the median gap, so they are left out of the per-pair ratios (never out of the "
            "ratio of means) and their normalised values are blank")
