"""The features section of `entoscope report`: which dictionary features carry IOI and induction.

For each task: attribution patching (denoising: each feature of each layer's resid_post SAE at the
last positions, patched from the prompt into its counterfactual; one forward, one backward and one
source forward per batch, patching/attribution.py) with the patching table's bootstrap intervals and
BH q-values; the strongest features by |mean effect| are listed with their intervals and get feature
pages (top activating examples, logit effects, histogram: dictionaries/pages.py). One attribution
graph over the same SAEs on a few IOI prompts gives the replacement and completeness scores
(dictionaries/graph.py). Models without dictionaries that fit get a sentence saying so.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from ...data import tasks
from ...data.examples import Dataset
from ...errors import EntoscopeError
from ...models.adapter import adapt
from ...registry import register
from ..section import Section

RELEASE = "demo"
TASKS = (("ioi", "IOI (logit difference: IO minus S)", [-1, -2, -3]),
         ("induction", "induction (the repeated token's logit difference)", [-1, -2]))
COLUMNS = ["site", "layer", "position", "feature", "value", "value_ci_low", "value_ci_high", "value_q"]


def _top(table: pd.DataFrame, k: int) -> pd.DataFrame:
    order = table["value"].abs().sort_values(ascending=False, kind="stable").index
    return table.loc[order].head(k)


@register("report_section", "features")
def features_section(model: Any, folder: Path, quick: bool) -> Section:
    """Attribution patching over the demo dictionaries' features for IOI and induction, feature pages for the
    strongest, and one attribution graph's scores; the IOI Result is saved in `folder`, induction below it."""
    from ...dictionaries.graph import FeatureGraphOperation
    from ...dictionaries.pages import page_name, write_feature_pages
    from ...patching import Patching
    from ...results.page import table_html, write_page
    from ...sites import Sites

    title = "dictionary features: which SAE features carry IOI and induction"
    folder = Path(folder)
    try:
        Sites(activation="resid_post", dictionary=RELEASE, over=["layer"]).resolve(adapt(model))
    except EntoscopeError as err:
        write_page(folder / "index.html", title, [("not run", f"<p>{html.escape(err.message)}</p>")],
                   js_relpath="../plotly.min.js", back="../index.html")
        return Section(title, "Not run: no dictionaries fit this model.",
                       f"<p>No dictionaries fit this model ({html.escape(err.code)}): the section needs the demo "
                       "model's bundled SAEs, or your own registered for this model (docs/features.md).</p>")
    n, k = (24, 5) if quick else (96, 8)
    chosen: list[tuple[str, int]] = []
    notes: dict[tuple[str, int], str] = {}
    parts, tops = [], []
    for t, (task, label, positions) in enumerate(TASKS):
        sites = Sites(activation="resid_post", dictionary=RELEASE, over=["layer", "position", "feature"],
                      positions=positions)
        result = Patching(method="attribution", sites=sites, comparison="difference", per_prompt=False).run(
            model, {"task": task, "n": n, "seed": 21}, quiet=True)
        where = folder if t == 0 else folder / f"example{t}"
        result.save(where, assets_dir=folder.parent)
        top = _top(result.table, k)
        tops.append((task, label, top, where, len(result.table)))
        for row in top.itertuples():
            key = (row.dictionary, int(row.feature))
            if key not in notes:
                chosen.append(key)
                notes[key] = ""
            notes[key] += (f"{task}: mean effect {row.value:.3g} [{row.value_ci_low:.3g}, {row.value_ci_high:.3g}] "
                           f"when patched at position {row.position}. ")
    m = 16 if quick else 48
    shown_on = Dataset("ioi+induction", tuple(tasks.ioi(n=m, seed=5)) + tuple(tasks.induction(n=m, seed=5)))
    pages = write_feature_pages(model, chosen, shown_on, folder / "pages", assets_dir=folder.parent,
                                back="../index.html", notes=notes)
    for task, label, top, where, n_sites in tops:
        shown = top[[c for c in COLUMNS if c in top]].copy()
        shown.insert(1, "dictionary", top["dictionary"])
        links = " ".join(f'<a href="{folder.name}/pages/{page_name(d, int(f))}">{html.escape(d)} f{int(f)}</a>'
                         for d, f in zip(top["dictionary"], top["feature"]))
        full = "" if where == folder else f' (<a href="{folder.name}/{where.name}/index.html">full results</a>)'
        parts.append(f"<h3>{html.escape(label)}</h3><p>Attribution patching of {n_sites} feature sites "
                     f"({n} pairs, denoising: the prompt's feature value written into the counterfactual run); the "
                     f"{len(top)} largest mean effects on the metric, with {_level(top)} bootstrap intervals and BH q-values over all "
                     f"{n_sites} sites{full}:</p>"
                     + table_html(shown) + f"<p>Feature pages: {links}</p>")
    graph = FeatureGraphOperation(dictionary=RELEASE, activation="resid_post", max_features=24).run(
        model, {"task": "ioi", "n": 4 if quick else 16, "seed": 21}, quiet=True)
    graph.save(folder / "graph", assets_dir=folder.parent)
    s, whole = graph.extra["scores"], graph.extra["dataset_scores"]
    parts.append(f"<h3>attribution graph (IOI, {len(s)} prompts)</h3><p>Replacement score {whole['replacement']:.2f}, "
                 f"completeness {whole['completeness']:.2f} on the dataset graph; per prompt replacement "
                 f"{s['replacement'].mean():.2f} (range {s['replacement'].min():.2f}-{s['replacement'].max():.2f}), "
                 f"completeness {s['completeness'].mean():.2f} (Ameisen et al. 2025; docs/features.md).</p>"
                 f'<p><a href="{folder.name}/graph/index.html">the graph\'s nodes, edges and scores</a>; '
                 f'<a href="{folder.name}/pages/index.html">all {len(pages)} feature pages</a></p>')
    best = "; ".join(f"{task}: {r.dictionary} f{int(r.feature)} at position {r.position}, {r.value:.2g} "
                     f"[{r.value_ci_low:.2g}, {r.value_ci_high:.2g}]"
                     for task, _, top, _, _ in tops for r in top.head(1).itertuples())
    lead = (f"The SAE feature whose patch moves each task's metric most (attribution patching, 95% intervals over "
            f"{n} pairs): {best}. The SAEs replace the residual stream imperfectly: on IOI the attribution graph's "
            f"replacement score is {whole['replacement']:.2f} and its completeness {whole['completeness']:.2f}.")
    if all(float(top["value_q"].min()) > 0.05 for _, _, top, _, _ in tops if "value_q" in top):
        lead += (" No single feature site survives the false discovery control over all the sites tested (every "
                 "q-value above 5%): read these features as candidates for a closer look, not findings.")
    return Section(title, lead, "".join(parts),
                   terms=("feature", "attribution patching", "replacement score", "completeness score", "95% interval"))


def _level(top: pd.DataFrame) -> str:
    return f"{float(top['ci_level'].iloc[0]):.0%}" if "ci_level" in top and len(top) else "the"
