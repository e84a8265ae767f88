"""Feature pages: the dashboard view of a dictionary feature, offline, in a run's folder.

    write_feature_pages(model, [("demo/resid_post.1", 142), ...], data, folder)

One page per feature, and an index of them (folder/index.html, or `index` elsewhere):
  - the dataset examples that activate it most: each prompt's tokens, shaded by the feature's activation
    (hover a token for its value), the highest first (one row per prompt, at its strongest position);
  - its logit effects: the decoder row through the final norm (scale frozen) and W_U, top and bottom
    tokens (decoder_lens, dictionaries/lens.py);
  - its activation histogram over every token of the dataset where it is active, with the share of
    tokens where it is (the BOS position is left out: dictionaries are not trained there).
Activations are read through the features.L@KEY sites (the model layer encodes), in batches.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from .. import naming
from ..data.loading import load_data
from ..data.tokenized import make_batches, pad_id, tokenize_data
from ..models.adapter import adapt
from ..models.names import ActName, parse_name
from ..results.claims import Takeaway, write_takeaways
from ..results.page import (
    PLOTLY_JS,
    ensure_plotly_js,
    figure_div,
    table_html,
    write_page,
)
from ..models.dictionaries.catalog import get_dictionary

FeatureKey = tuple[str, int]  # (dictionary key, feature index)


def page_name(key: str, feature: int) -> str:
    """The file name of a feature's page (safe on every file system)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + f"_f{feature}.html"


def feature_name(key: str, feature: int) -> str:
    """A dictionary feature's name in the naming scheme: its site and index (resid_post.1.f29)."""
    out = parse_name(get_dictionary(key).hook_out)
    return naming.feature(out.kind, out.layer, feature)


def feature_activations(model: Any, features: list[FeatureKey], data: Any, batch_size: int = 32
                        ) -> tuple[list[list[int]], dict[FeatureKey, list[np.ndarray]]]:
    """(token ids of each prompt, {feature: each prompt's activations per position}) over the prompts."""
    a = adapt(model)
    ds = load_data(data, tokenizer=a.tokenizer)
    td = tokenize_data(a, ds)
    keys = sorted({k for k, _ in features})
    acts = {k: ActName("features", parse_name(get_dictionary(k).hook_out).layer, k) for k in keys}
    out: dict[FeatureKey, list[np.ndarray]] = {f: [np.zeros(0)] * len(td) for f in features}
    with torch.no_grad():
        for b in make_batches(td, batch_size, pad_id(a)):
            run = a.run(b.tokens, list(acts.values()), logits=False)
            for key, i in features:
                values = run[acts[key]][..., i].float().cpu().numpy()
                for row, e in enumerate(b.index):
                    out[(key, i)][e] = values[row, : int(b.lengths[row])]
    return td.prompts, out


def _tokens_html(tokens: list[str], values: np.ndarray, top: float) -> str:
    spans = []
    for t, v in zip(tokens, values):
        alpha = 0.0 if top <= 0 else float(np.clip(v / top, 0, 1))
        style = f"background: rgba(43,108,176,{alpha:.2f});" + (" color: #fff;" if alpha > 0.6 else "")
        spans.append(f'<span class="tok" style="{style}" title="{v:.3g}">{html.escape(t)}</span>')
    return '<div class="tokens">' + "".join(spans) + "</div>"


TOKEN_STYLE = """<style>.tokens { font-family: ui-monospace, monospace; font-size: 0.85em; white-space: pre-wrap;
word-break: break-word; margin: 0.2em 0 0.6em; } .tok { border-radius: 2px; }</style>"""


def _histogram(values: np.ndarray, share: float) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure(go.Histogram(x=values, nbinsx=40, marker_color="#2b6cb0"))
    fig.update_layout(xaxis_title="activation (tokens where the feature is active)", yaxis_title="tokens",
                      height=300, title=f"active on {share:.1%} of tokens")
    return fig


def write_feature_pages(model: Any, features: list[FeatureKey], data: Any, folder: str | Path, *,
                        top_examples: int = 8, top_tokens: int = 8, assets_dir: str | Path | None = None,
                        back: str | None = None, notes: dict[FeatureKey, str] | None = None) -> dict[FeatureKey, Path]:
    """Write one page per feature (and folder/index.html listing them); returns each feature's page.

    assets_dir: where plotly.min.js is (written there if missing; default: folder).
    back: a link from the index to the page above it; notes: a sentence per feature shown at its top."""
    from .lens import DecoderLens

    a = adapt(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    assets = Path(assets_dir) if assets_dir is not None else folder
    ensure_plotly_js(assets)
    js = os.path.relpath(assets / PLOTLY_JS, folder)
    prompts, acts = feature_activations(model, features, data)
    strings = [a.token_strs(p) for p in prompts]
    lens: dict[str, pd.DataFrame] = {}
    for key in sorted({k for k, _ in features}):
        chosen = sorted({i for k, i in features if k == key})
        table = DecoderLens(dictionary=key, features=chosen, top_k=top_tokens).run(model, quiet=True).table
        lens[key] = table.set_index("feature")
    pages: dict[FeatureKey, Path] = {}
    rows = []
    for key, i in features:
        per_prompt = acts[(key, i)]
        body = [v[1:] for v in per_prompt]  # BOS left out
        every = np.concatenate(body) if body else np.zeros(0)
        active = every[every != 0]
        share = float(len(active) / max(1, len(every)))
        best = np.array([v.max() if len(v) else -np.inf for v in body])
        order = [int(e) for e in np.argsort(-best, kind="stable")[:top_examples] if best[e] > 0]
        top = float(best[order[0]]) if order else 0.0
        examples = "".join(f"<p class=\"note\">prompt {e}: max {best[e]:.3g} at token {int(np.argmax(body[e])) + 1}</p>"
                           + _tokens_html(strings[e], per_prompt[e], top) for e in order)
        if not order:
            examples = "<p>the feature is not active on any token of these prompts.</p>"
        row = lens[key].loc[i]
        effects = pd.DataFrame({
            "promoted": [row[f"top{t}_token"] for t in range(1, top_tokens + 1)],
            "promoted score": [row[f"top{t}_score"] for t in range(1, top_tokens + 1)],
            "suppressed": [row[f"bottom{t}_token"] for t in range(1, top_tokens + 1)],
            "suppressed score": [row[f"bottom{t}_score"] for t in range(1, top_tokens + 1)],
        })
        sections = [
            ("top activating examples", TOKEN_STYLE + examples),
            ("logit effects (decoder row through the final norm and W_U)",
             table_html(effects) + '<p class="note">scores per unit of activation, before the final norm\'s '
             "1/scale: they rank tokens; see docs/features.md.</p>"),
            ("activation histogram", figure_div(_histogram(active, share)) if len(active) else
             "<p>no active token.</p>"),
        ]
        lead = (notes or {}).get((key, i), "") or f"feature {i} of {key} on {len(prompts)} prompts."
        path = write_page(folder / page_name(key, i), f"{feature_name(key, i)}: feature {i} of the {key} dictionary",
                          sections, js_relpath=js, lead=lead, back="index.html")
        pages[(key, i)] = path
        rows.append(f'<li><a href="{path.name}">{html.escape(feature_name(key, i))}</a> ({html.escape(key)}): '
                    f"active on {share:.1%} of tokens, at most {top:.3g}; promotes "
                    f"{html.escape(str(row['top1_token']))!s}</li>")
    body = "<ul>" + "".join(rows) + "</ul>"
    write_page(folder / "index.html", "feature pages", [("features", body)], js_relpath=js, back=back,
               lead="The features below: their top activating examples, logit effects and histograms.")
    leads = [(page_name(k, i), notes[(k, i)]) for k, i in features if isinstance((notes or {}).get((k, i)), Takeaway)]
    if leads:  # the pages' leads with their claims (results/claims.py)
        write_takeaways(folder / "takeaways.json", leads)
    return pages
