"""The inspect view, as the sections of a run's page and as one block of a notebook's output: the prompt's tokens
with the model's top next tokens, a token grid per lens (each cell the top token, its probability as the
colour; hover: the probabilities, the answer's place, the KL to the output), every head's attention (small
multiples, and a token-to-token view of one head: assets/inspect.js), the attribution and patching figures.
Everything is inline (no network): the grids are HTML, the attention view's script and data are in the page,
plotly.js is the run folder's copy (a page) or sent once per kernel (a notebook: results/notebook.py)."""

from __future__ import annotations

import base64
import html
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..results.page import figure_div, table_html
from .figures import dla_figures, metric_label, patching_figure, shown
from .takeaway import dla_line, lens_line, patching_line

ASSETS = Path(__file__).resolve().parent / "assets"
LENS_TITLES = {"logit": "logit lens", "tuned": "tuned lens", "jacobian": "Jacobian lens"}


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def _visible(token: Any) -> str:
    """A token's text with its spaces made visible (U+2423), escaped for HTML."""
    return html.escape(str(token).replace(" ", "\u2423"))


def _shade(p: float) -> str:
    """The background of a cell whose value is a probability p (white at 0, dark blue at 1)."""
    a = 0.0 if not np.isfinite(p) else float(min(1.0, max(0.0, p)))
    return f"background: rgba(8, 81, 156, {a:.3f})"


def _header(tokens: list[str], differs: set[int] | None = None) -> str:
    cells = "".join(f'<th class="{"esi-differs" if differs and p in differs else ""}" title="position {p}">'
                    f'<span class="esi-pos">{p}</span><span class="esi-tok">{_visible(t)}</span></th>'
                    for p, t in enumerate(tokens))
    return f"<thead><tr><th class=\"esi-row\"></th>{cells}</tr></thead>"


def predictions_html(t: pd.DataFrame) -> str:
    """The prompt's tokens (columns) and the model's top next tokens under each, shaded by probability."""
    k = sum(1 for c in t.columns if c.startswith("top") and c.endswith("_token"))
    tokens = [str(x) for x in t["token"]]
    rows = []
    for i in range(1, k + 1):
        cells = []
        for r in t.itertuples():
            tok, p = getattr(r, f"top{i}_token"), float(getattr(r, f"top{i}_prob"))
            dark = " esi-dark" if p > 0.55 else ""
            tip = f"after position {r.position} {shown(r.token)}: top {i} {shown(tok)}, probability {p:.4f}"
            cells.append(f'<td class="esi-tok{dark}" style="{_shade(p)}" title="{html.escape(tip)}">'
                         f"{_visible(tok)}</td>")
        rows.append(f'<tr><th class="esi-row">top {i}</th>{"".join(cells)}</tr>')
    note = '<p class="esi-note">Columns: the prompt\'s tokens (\u2423 is a space); under each, the model\'s most ' \
           'probable next tokens, shaded by probability (hover for it).</p>'
    return note + f'<div class="esi-scroll"><table class="esi-grid-t">{_header(tokens)}<tbody>{"".join(rows)}</tbody>' \
                  "</table></div>"


def lens_html(lens: pd.DataFrame, tokens: list[str], answer: str | None) -> str:
    """One lens's grid: layers down, positions across; each cell the top token, shaded by its probability."""
    k = sum(1 for c in lens.columns if c.startswith("top") and c.endswith("_token"))
    by = {(int(r.layer), int(r.position)): r for r in lens.itertuples()}
    rows = []
    for L in sorted(lens["layer"].unique()):
        cells = []
        for p in range(len(tokens)):
            r = by.get((int(L), p))
            if r is None:
                cells.append("<td></td>")
                continue
            p1 = float(r.top1_prob)
            lines = [f"layer {L}, position {p} {shown(tokens[p])}"]
            lines += [f"{i}. {shown(getattr(r, f'top{i}_token'))} {float(getattr(r, f'top{i}_prob')):.4f}"
                      for i in range(1, k + 1)]
            if answer is not None and hasattr(r, "answer_rank"):
                above = int(r.answer_rank)
                place = "the top token" if above == 0 else f"{above} token{'s' if above != 1 else ''} above it"
                lines.append(f"answer {shown(answer)}: {place}, probability {r.answer_prob:.4f}")
            lines.append(f"KL(output || lens) {r.kl_to_final:.3f} nats")
            cls = "esi-tok" + (" esi-dark" if p1 > 0.55 else "") + (" esi-ans" if answer is not None and
                                                                     r.top1_token == answer else "")
            cells.append(f'<td class="{cls}" style="{_shade(p1)}" title="{html.escape(chr(10).join(lines))}">'
                         f"{_visible(r.top1_token)}</td>")
        rows.append(f'<tr><th class="esi-row">L{int(L)}</th>{"".join(cells)}</tr>')
    return (f'<div class="esi-scroll"><table class="esi-grid-t">{_header(tokens)}<tbody>{"".join(rows)}</tbody>'
            "</table></div>")


def attention_html(result: Any) -> str:
    """The attention view: its container, its data (JSON, the weights as base64 float32) and its script."""
    uid = f"esi-{uuid.uuid4().hex[:12]}"
    patterns = result.extra["patterns"]  # [L, H, T, T]
    L, H, T, _ = patterns.shape
    q, k = np.tril_indices(T)
    weights = np.ascontiguousarray(patterns[:, :, q, k], dtype="<f4")
    size, layers = result.extra["window"]
    data: dict[str, Any] = {"T": int(T), "n_layers": int(L), "n_heads": int(H), "tokens": result.tokens,
                            "window": {"size": int(size), "layers": [int(x) for x in layers]} if size else None,
                            "attention": base64.b64encode(weights.tobytes()).decode("ascii"), "first": [0, 0]}
    dla = result.tables.get("dla")
    if dla is not None:
        heads = dla[dla["kind"] == "head"]
        data["dla"] = {f"{int(r.layer)}.{int(r.head)}": float(r.contribution) for r in heads.itertuples()}
        data["dla_label"] = metric_label(result.extra["dla_terms"]["metric"], result.extra["answer"],
                                         result.extra["wrong"])
        top = heads.loc[heads["contribution"].abs().idxmax()]
        data["first"] = [int(top["layer"]), int(top["head"])]
    payload = json.dumps(data).replace("</", "<\\/")
    local = ""
    if size:
        marked = ", ".join(f"L{x}" for x in layers)
        local = f" Sliding-window layers (marked \u25e7: {marked}) let each query see only its last {size} tokens"
        local += ": this prompt is shorter, so nothing is cut off." if T <= size else \
            "; the keys outside the window are orange."
    legend = ('<div class="esi-legend"><span><i style="background:#fff"></i>0</span>'
              '<span><i style="background:rgb(8,81,156)"></i>1</span>'
              '<span><i style="background:rgb(240,240,240)"></i>after the query (masked)</span>'
              + ('<span><i style="background:rgb(253,221,182)"></i>outside the sliding window</span>' if size else "")
              + "</div>")
    first = f"a{data['first'][0]}.h{data['first'][1]}"
    shown_first = f" Shown first: {first}, the head of largest |direct contribution|." if dla is not None else ""
    note = ('<p class="esi-note">Each square is one head\'s attention pattern (queries down, keys across); click one '
            "to enlarge it. In the enlarged view hover a cell for its weight and click a row or a token to see where "
            f"that query looks.{local}{shown_first}</p>")
    return (f'<div class="esi-attn" id="{uid}">{note}{legend}'
            '<p class="esi-nojs esi-note">(This view is drawn by JavaScript, which is off here; the weights are in '
            'attention.csv.)</p>'
            '<div class="esi-attn-body"><div class="esi-gridbox"><div class="esi-heads"></div></div>'
            '<div class="esi-detail"><h4 class="esi-detail-title"></h4><div class="esi-strip"></div>'
            '<canvas class="esi-matrix"></canvas><div class="esi-readout"></div></div></div>'
            f'<script type="application/json" id="{uid}-data">{payload}</script>'
            f"<script>{_asset('inspect.js')}\nwindow.entoscopeInspect({json.dumps(uid)});</script></div>")


def _lines(result: Any) -> list[tuple[str, str]]:
    """(view, one line of what it shows) for each view that says something."""
    out = []
    t, answer = result.table, result.extra.get("answer")
    if answer is not None:
        token, what = answer, "the answer"
    else:
        token, what = str(t["top1_token"].iloc[-1]), "the model's prediction"
    for name, frame in _lenses(result):
        line = lens_line(frame, LENS_TITLES[name].replace(" lens", ""), token, what)
        if line:
            out.append((LENS_TITLES[name], line))
    if result.tables.get("dla") is not None:
        terms = result.extra["dla_terms"]
        label = metric_label(terms["metric"], answer, result.extra["wrong"])
        out.append(("direct logit attribution", dla_line(result.tables["dla"], terms, label)))
    if result.tables.get("patching") is not None:
        out.append(("activation patching", patching_line(result.tables["patching"], result.extra["patching_terms"])))
    return out


def _lenses(result: Any) -> list[tuple[str, pd.DataFrame]]:
    return [("logit" if name == "lens" else name.removesuffix("_lens"), frame) for name, frame in result.tables.items()
            if name == "lens" or name.endswith("_lens")]


def page_sections(result: Any) -> list[tuple[str, str]]:
    """The page's sections, in reading order (the takeaway is the page's lead)."""
    lines = _lines(result)
    glance = "".join(f"<li><strong>{html.escape(v)}</strong>: {html.escape(text)}</li>" for v, text in lines)
    sections = [("at a glance", f"<style>{_asset('inspect.css')}</style>"
                 + (f'<ul class="esi-glance">{glance}</ul>' if glance else ""))]
    sections.append(("prompt and predictions", predictions_html(result.table)))
    answer, tokens = result.extra.get("answer"), result.tokens
    for name, frame in _lenses(result):
        note = {"logit": "Each layer's resid_post through the final norm and the unembedding (nostalgebraist 2020), "
                "as es.Lens decodes it.",
                "tuned": "Each layer's resid_post through its tuned-lens translator, then the final norm and the "
                "unembedding (Belrose et al. 2023).",
                "jacobian": "Each layer's resid_post through its Jacobian-lens matrix, then the final norm and the "
                "unembedding (the layers the lens was fitted on)."}[name]
        note += " Each cell: the top token, shaded by its probability; hover for the top tokens"
        note += ", the answer's place (outlined where it is the top token)" if answer is not None else ""
        sections.append((LENS_TITLES[name], f'<p class="esi-note">{html.escape(note)} and the KL to the output.</p>'
                         + lens_html(frame, tokens, answer)))
    sections.append(("attention patterns", attention_html(result)))
    if result.tables.get("dla") is not None:
        terms = result.extra["dla_terms"]
        label = metric_label(terms["metric"], answer, result.extra["wrong"])
        ident = (f"Identity (checked): the rows sum to {terms['sum_of_rows']:.6g}, plus the constant (final norm bias "
                 f"and b_U) {terms['constant']:.6g}, = {terms['sum_of_rows'] + terms['constant']:.6g}; the model's own "
                 f"{label} is {terms['value']:.6g}. Each row: the component's output at the last position through the "
                 "final norm with its scale frozen at this run (Elhage et al. 2021). The embedding and the biases are "
                 "rows of dla.csv.")
        body = f'<p class="esi-note">{html.escape(ident)}</p>'
        body += "".join(f'<p class="esi-note"><strong>{html.escape(t)}</strong></p>{figure_div(f)}'
                        for t, f in dla_figures(result.tables["dla"], label))
        sections.append(("direct logit attribution", body))
    if result.tables.get("patching") is not None:
        terms = result.extra["patching_terms"]
        how = ("Denoising: the counterfactual runs, and resid_pre of one layer at one position is set to its value in "
               "the prompt's run; normalised = (patched - counterfactual) / (prompt - counterfactual).")
        if terms.get("derived"):
            how += f" No answer was given: the answer is the model's own prediction {shown(terms['answer'])}"
            how += f" and the wrong answer the counterfactual's {shown(terms['wrong'])}." if terms["wrong"] else "."
        body = f'<p class="esi-note">{html.escape(how)}</p>'
        body += "".join(f'<p class="esi-note">{html.escape(n)}</p>' for n in result.extra.get("notes", []))
        title, fig = patching_figure(result.tables["patching"], metric_label(terms["metric"], terms["answer"],
                                                                              terms["wrong"]))
        body += f'<p class="esi-note"><strong>{html.escape(title)}</strong></p>{figure_div(fig)}'
        sections.append(("activation patching", body))
    saved = ", ".join(f"{name}.csv ({len(frame):,} rows)" for name, frame in result.tables.items())
    sections.append(("table", table_html(result.table, note=result.blank_note)
                     + f'<p class="esi-note">Saved beside it: {html.escape(saved)}.</p>'))
    return sections


def notebook_view(result: Any) -> str:
    """The whole view as one output of a notebook: plotly.js sent once per kernel, everything else inline."""
    from ..results.notebook import plotly_once

    parts = [f'<div class="esi-root"><h3>{html.escape(result.title)}</h3>']
    if result.takeaway:
        parts.append(f'<p class="esi-lead"><strong>{html.escape(result.takeaway)}</strong></p>')
    sections = page_sections(result)
    if result.tables.get("dla") is not None or result.tables.get("patching") is not None:
        parts.append(plotly_once())
    parts += [f"<h4>{html.escape(t)}</h4>{body}" for t, body in sections]
    parts.append("</div>")
    return "".join(parts)
