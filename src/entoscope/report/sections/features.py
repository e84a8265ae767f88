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
import json
from pathlib import Path
from typing import Any

import pandas as pd

from ...data import tasks
from ...data.examples import Dataset
from ...errors import EntoscopeError
from ...models.adapter import adapt
from ...registry import register
from ..preflight import runs_by
from ..section import Section
from ..sizes import sizes
from ...results.claims import Takeaway, TakeawayBuilder
from ...results.page import lead_html

RELEASE = "demo"
TASKS = (("ioi", "IOI (logit difference: IO minus S)", [-1, -2, -3]),
         ("induction", "induction (the repeated token's logit difference)", [-1, -2]))
COLUMNS = ["site", "layer", "position", "feature", "value", "value_ci_low", "value_ci_high", "value_q"]


def _top(table: pd.DataFrame, k: int) -> pd.DataFrame:
    order = table["value"].abs().sort_values(ascending=False, kind="stable").index
    return table.loc[order].head(k)


def features_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    """Attribution patching over the features of each task; none where no dictionaries fit (the section
    then writes its own page saying so)."""
    from ...patching import Patching
    from ...sites import Sites

    try:
        Sites(activation="resid_post", dictionary=RELEASE, over=["layer"]).resolve(adapt(model))
    except EntoscopeError:
        return []
    n = sizes(model, "features", quick)["n"]
    return [(Patching(method="attribution", comparison="difference", per_prompt=False,
                      sites=Sites(activation="resid_post", dictionary=RELEASE, over=["layer", "position", "feature"],
                                  positions=positions)),
             {"task": task, "n": n, "seed": 21}) for task, _, positions in TASKS]


@register("report_section", "features")
@runs_by(features_runs)
def features_section(model: Any, folder: Path, quick: bool) -> Section:
    """Attribution patching over the demo dictionaries' features for IOI and induction, feature pages for the
    strongest, and one attribution graph's scores; the IOI Result is saved in `folder`, induction below it."""
    from ...dictionaries.graph import FeatureGraph
    from ...dictionaries.pages import feature_name, page_name, write_feature_pages
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
    n, k = sizes(model, "features", quick)["n"], 5 if quick else 8
    chosen: list[tuple[str, int]] = []
    notes: dict[tuple[str, int], TakeawayBuilder] = {}
    parts, tops = [], []
    for t, ((task, label, positions), (op, data)) in enumerate(zip(TASKS, features_runs(model, quick))):
        result = op.run(model, data, quiet=True)
        where = folder if t == 0 else folder / f"example{t}"
        result.save(where, assets_dir=folder.parent)
        top = _top(result.table, k)
        tops.append((task, label, top, where, result.table))
        rel = where.relative_to(folder).as_posix()
        for _, row in top.iterrows():
            key = (row["dictionary"], int(row["feature"]))
            if key not in notes:
                chosen.append(key)
                notes[key] = TakeawayBuilder(key="site")
            note, source = notes[key], f"../{rel}/table.csv".replace("/./", "/")
            note.say(f"{task}: ")
            note.count(int(result.table["significant"].sum()), len(result.table), "significant", source=source,
                       unit="feature sites")
            note.say(" pass the false discovery control; patching this feature (attribution patching, its mean "
                     "effect on the metric over the pairs): ")
            note.quote(row, "value", fmt=".3g", source=source)
            note.say(". ")
    m = 16 if quick else 48
    shown_on = Dataset("ioi+induction", tuple(tasks.ioi(n=m, seed=5)) + tuple(tasks.induction(n=m, seed=5)))
    pages = write_feature_pages(model, chosen, shown_on, folder / "pages", assets_dir=folder.parent,
                                back="../index.html", notes={k: v.build() for k, v in notes.items()})
    for task, label, top, where, table in tops:
        n_sites = len(table)
        shown = top[[c for c in COLUMNS if c in top]].copy()
        shown.insert(1, "dictionary", top["dictionary"])
        links = " ".join(f'<a href="{folder.name}/pages/{page_name(d, int(f))}">'
                         f"{html.escape(feature_name(d, int(f)))}</a>" for d, f in zip(top["dictionary"], top["feature"]))
        full = "" if where == folder else f' (<a href="{folder.name}/{where.name}/index.html">full results</a>)'
        parts.append(f"<h3>{html.escape(label)}</h3><p>Attribution patching of {n_sites} feature sites "
                     f"({n} pairs, denoising: the prompt's feature value written into the counterfactual run); the "
                     f"{len(top)} largest mean effects on the metric, with {_level(top)} bootstrap intervals and BH "
                     f"q-values over all {n_sites} sites; {int(table['significant'].sum())} of them pass the false "
                     f"discovery control{full}:</p>"
                     + table_html(shown) + f"<p>Feature pages: {links}</p>")
    graph = FeatureGraph(dictionary=RELEASE, activation="resid_post", max_features=24).run(
        model, {"task": "ioi", "n": 4 if quick else 16, "seed": 21}, quiet=True)
    graph.save(folder / "graph", assets_dir=folder.parent)
    parts.append(f"<h3>attribution graph (IOI, {len(graph.extra['scores'])} prompts)</h3>"
                 + lead_html(graph.takeaway, "takeaway") +
                 f'<p><a href="{folder.name}/graph/index.html">the graph\'s nodes, edges and scores</a>; '
                 f'<a href="{folder.name}/pages/index.html">all {len(pages)} feature pages</a></p>')
    lead = _lead(folder.name, n, tops, graph)
    return Section(title, lead, "".join(parts),
                   terms=("feature", "attribution patching", "replacement score", "completeness score", "error node",
                          "95% interval", "q-value", "names"))


def _lead(name: str, n: int, tops: list[tuple[Any, ...]], graph: Any) -> Takeaway:
    """The section's lead: first how many feature sites survive the false discovery control (the finding
    or its absence), then each task's largest effect with its interval and q, then the graph's scores."""
    b = TakeawayBuilder(key="site")
    sources = {task: f"{name}/table.csv" if where.name == name else f"{name}/{where.name}/table.csv"
               for task, _, _, where, _ in tops}
    counts = {task: int(table["significant"].sum()) for task, _, _, _, table in tops}
    if not any(counts.values()):
        none = b.qualify("No feature site survives the false discovery control", "none_significant")
        b.say(" (")
        refs = []
        for i, (task, _, _, _, table) in enumerate(tops):
            b.say(", " if i else "")
            refs.append(b.count(0, len(table), "significant", source=sources[task], unit=f"on {task}"))
        b.refer(none, refs)
        b.say(" at a ")
        b.setting(_fdr(tops[0][3]), "stats.fdr", fmt=".0%", source=f"{name}/manifest.json")
        b.say(" false discovery rate): the features below are candidates for a closer look, not findings. ")
        b.end_lead()
    else:
        for i, (task, _, _, _, table) in enumerate(tops):
            b.say("; " if i else "")
            b.count(counts[task], len(table), "significant", source=sources[task], unit=f"feature sites on {task}")
        b.say(" pass the false discovery control. ")
        b.end_lead()
    first = tops[0][4]
    b.say("The ")
    word = b.qualify("largest |mean effect|", "top_by_abs")
    b.say(" of patching one feature (attribution patching, ")
    b.constant(first["ci_level"].iloc[0], "ci_level", fmt=".0%", source=sources[tops[0][0]])
    b.say(" intervals over ")
    b.constant(first["n_prompts"].iloc[0], "n_prompts", unit="pairs", source=sources[tops[0][0]])
    b.say("): ")
    refs = []
    for i, (task, _, top, _, _) in enumerate(tops):
        b.say("; " if i else "")
        b.say(f"{task} ")
        refs.append(b.quote(top.iloc[0], "value", source=sources[task]))  # each the first of its own table
    b.refer(word, refs)
    b.say(". On IOI the SAEs explain the model only in part: the mean attribution graph's replacement score is ")
    s = graph.extra["score_table"].set_index("example", drop=False).loc["dataset"]
    b.quote(s, "replacement", key="example", name=False, source=f"{name}/graph/scores.csv")
    b.say(" and its completeness ")
    b.quote(s, "completeness", key="example", name=False, source=f"{name}/graph/scores.csv")
    b.say(" (a score of one: no error).")
    return b.build()


def _fdr(where: Path) -> float:
    """The false discovery rate a saved run used (its manifest's stats.fdr)."""
    manifest = json.loads((Path(where) / "manifest.json").read_text(encoding="utf-8"))
    return float(manifest["config"]["stats"]["fdr"])


def _level(top: pd.DataFrame) -> str:
    return f"{float(top['ci_level'].iloc[0]):.0%}" if "ci_level" in top and len(top) else "the"
