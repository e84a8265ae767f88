"""Lenses side by side: the logit, tuned and Jacobian lenses on the same prompts, layer by layer
(`LensComparison`, operation `lens_comparison`; `compare_lenses` is the same in one call).

Per lens and layer, at each prompt's last token (END): `kl_mean`, the mean KL(model's final distribution ||
lens distribution) in nats with its bootstrap interval over prompts (the lens operation's), and `agree`,
the share of prompts whose lens top-1 token is the model's own top-1 token, with its Wilson interval
(stats/proportion.py). A lens is *informative from* layer l when, from l to the last layer, the agreement is
"most" prompts at every layer (docs/pages.md: the share >= 1/2 and its interval's lower end > 1/2; the column
`informative_from`, the same on each of the lens's rows, -1 where no layer qualifies). The takeaway is built
from claims (results/claims.py): each share and KL it states is a cell of the table.

The Jacobian lens is read from `lens`, or, when none is given, fitted in the run on `fit_data` (a few corpus
texts by default; jacobian_source.py) and the page says so; `fit_data: null` compares without it. The tuned
lens is compared where `translators` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
from pydantic import Field

from ..data.examples import Dataset
from ..models.adapter import ModelAdapter
from ..operation import Operation, Plan, Prepared, register_operation
from ..results.claims import Takeaway, TakeawayBuilder, most
from ..results.figures import interval_note, noted
from ..results.result import Result
from ..sites import Selection, Sites
from ..stats import Stats
from ..stats.columns import interval_bars, level_text
from ..stats.proportion import share_interval
from .jacobian_source import JacobianSource, LensSource, prepare_source
from .operation import Lens

LENS_NAMES = {"logit": "logit", "tuned": "tuned", "jacobian": "Jacobian"}
SETTLED = 0.1  # a Jacobian lens's layer is settled when its split-half change is under this (docs/lens.md)


def title_of(methods: list[str]) -> str:
    """The page's title, naming the lenses that were run: "logit and Jacobian lenses side by side: ..."."""
    names = [LENS_NAMES.get(m, m) for m in methods]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} lens{'es side by side' if len(names) > 1 else ''}: agreement with the model's top token and KL"


@dataclass(frozen=True)
class ComparisonState:
    """Each lens's prepared run (the Jacobian lens's, when fitted here, gets its matrices at run time)."""

    runs: list[tuple[str, Lens, Prepared[Any]]]
    source: LensSource


@register_operation
class LensComparison(JacobianSource, Operation):
    """The logit, tuned and Jacobian lenses side by side on the same prompts' last tokens, layer by layer.

    layers:       the block outputs (resid_post) compared; default every layer.
    translators:  a tuned lens's folder (compared where given).
    lens:         a Jacobian lens file or folder; without it one is fitted in the run on fit_data (few texts:
                  said on the page), and fit_data: null leaves the Jacobian lens out.
    """

    name = "lens_comparison"
    layers: Selection = Field(default="all", description="the block outputs (resid_post) compared: all, an index, a "
                              "list, or a range a:b")
    translators: str | None = Field(default=None, description="a tuned lens's folder (compared where given)")

    def not_sharded_reason(self) -> str:
        return "it runs each lens (and a Jacobian fit) one after the other"

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[ComparisonState]:
        assert data is not None
        sites = Sites(activation="resid_post", over=["layer"], layers=self.layers)
        common = dict(sites=sites, top_k=1, stats=self.stats, seed=self.seed, batch_size=self.batch_size,
                      memory=self.memory, prepend_bos=self.prepend_bos)
        logit = Lens(**common)
        runs = [("logit", logit, logit.prepare(model, data))]
        if self.translators:
            tuned = Lens(method="tuned", translators=self.translators, **common)
            runs.append(("tuned", tuned, tuned.prepare(model, data)))
        layers = sorted({int(u.get("layer")) for u in runs[0][2].state.siteset.units})
        last = model.structure.n_layers - 1
        source = prepare_source(self, model, required=False, layers=[L for L in layers if L < last] or [0])
        if source.lens is not None:
            jac = Lens(method="jacobian", lens=self.lens, **common)
            runs.append(("jacobian", jac, jac.prepare(model, data)))
        elif source.fit is not None:
            runs.append(("jacobian", logit, runs[0][2]))  # the logit run's batches, read through the fitted J
        plans = [r[2].plan for r in runs]
        notes = [source.note] if source.note else []
        plan = Plan(self.name, rows=sum(p.rows for p in plans), batch_sizes=[b for p in plans for b in p.batch_sizes],
                    forward_passes=sum(p.forward_passes for p in plans) + source.forward_passes,
                    backward_passes=source.backward_passes, examples=plans[0].examples,
                    peak_memory_bytes=max([p.peak_memory_bytes for p in plans]
                                          + ([source.fit.plan.peak_memory_bytes] if source.fit else [])),
                    notes=notes + plans[0].notes)
        return Prepared(model, data, plan, ComparisonState(runs, source))

    def execute(self, prepared: Prepared[ComparisonState], *, quiet: bool = False) -> Result:
        st = prepared.state
        fitted = st.source.resolve(quiet=quiet) if st.source.fit is not None else None
        frames = []
        for method, op, run in st.runs:
            if method == "jacobian" and fitted is not None:
                for row in run.state.rows:
                    fitted.index_of(row["act"])
                run = replace(run, state=replace(run.state, lens=fitted), contexts={})
            r = op.execute(run, quiet=quiet)
            frames.append(_lens_rows(method, r, self.stats))
            if method == "jacobian":
                frames[-1] = _settledness(frames[-1], fitted or st.source.lens)
        table = pd.concat(frames, ignore_index=True)
        result = Result(self.name, table, takeaway=_takeaway, title=title_of([m for m, _, _ in st.runs]),
                        figures=_figures,
                        extra={"jacobian_note": st.source.note, "jacobian_fitted": fitted is not None,
                               "jacobian_lens": fitted or st.source.lens})
        if st.source.note:
            result.notes.append(("the Jacobian lens", st.source.note))
        return result


def compare_lenses(model: Any, data: Any, *, translators: str | None = None, jacobian: str | None = None,
                   layers: Any = "all", stats: Stats | None = None, seed: int = 0, quiet: bool = True) -> Result:
    """Run the logit lens, and the tuned (`translators`) and Jacobian (`jacobian`) lenses where given, on the
    same prompts' last tokens; one row per lens and layer (see the module docstring). Fits nothing."""
    op = LensComparison(translators=translators, lens=jacobian, fit_data=None, layers=layers,
                        stats=stats or Stats(), seed=seed)
    return op.run(model, data, quiet=quiet)


def _lens_rows(method: str, r: Result, stats: Stats) -> pd.DataFrame:
    """One lens's rows: its KL with interval, its agreement with the model's top token with Wilson's."""
    pp = r.per_prompt
    last = pp["layer"].max()
    model_top = pp[pp["layer"] == last].set_index("example")["top1_token"]  # the last layer decodes the logits
    pp = pp.assign(agree=(pp["top1_token"].to_numpy() == model_top.reindex(pp["example"]).to_numpy()))
    share = pp.groupby("layer")["agree"].agg(["mean", "count"])
    t = r.table[["layer", "n_prompts", "kl_mean", "kl_mean_ci_low", "kl_mean_ci_high"]].copy()
    t.insert(0, "lens", method)
    t["agree"] = share["mean"].reindex(t["layer"]).to_numpy()
    low, high = share_interval(t["agree"].to_numpy(), share["count"].reindex(t["layer"]).to_numpy(), stats.ci_level)
    t["agree_ci_low"], t["agree_ci_high"] = low, high
    t["informative_from"] = _informative_from(t)
    t["ci_level"] = stats.ci_level
    t["row"] = [f"{method} L{L}" for L in t["layer"]]  # one id per row (the figures' bars name it)
    return t


def _settledness(rows: pd.DataFrame, lens: Any) -> pd.DataFrame:
    """The Jacobian lens's rows with what it was fitted on: `fit_texts` (its prompts) and, per layer,
    `split_half_change` (||J_even - J_odd|| / ||J||, jacobian_fit.py; NaN where the lens has no record, as a
    TransformerLens file, and at the last layer, where the lens is the identity); a layer is settled when it is
    under SETTLED."""
    rows = rows.copy()
    change = getattr(lens, "settledness", {}) or {}
    rows["fit_texts"] = int(getattr(lens, "n_prompts", 0) or 0) or float("nan")
    rows["split_half_change"] = [float(change.get(int(L), float("nan"))) for L in rows["layer"]]
    return rows


def _figures(result: Result) -> list[tuple[str, Any]]:
    """Agreement with the model's top token and KL(final || lens) by layer, one line per lens, with intervals."""
    import plotly.graph_objects as go

    t = result.table
    figs = []
    for col, label in (("agree", "share of prompts whose lens top token is the model's"),
                       ("kl_mean", "KL(final || lens), nats")):
        fig = go.Figure()
        for lens, rows in t.groupby("lens", sort=False):
            rows = rows.sort_values("layer")
            fig.add_trace(go.Scatter(x=rows["layer"], y=rows[col], mode="lines+markers", name=f"{lens} lens",
                                     **interval_bars(rows, col, "row")))
        fig.update_layout(xaxis_title="layer", yaxis_title=noted(label, interval_note(level_text(t))), height=360,
                          legend={"orientation": "h"})
        fig.update_xaxes(dtick=1)
        figs.append((f"{label} by layer", fig))
    return figs


def _informative_from(rows: pd.DataFrame) -> int:
    """The first layer from which every layer's agreement is "most" prompts (rule `most`); -1 for none."""
    rows = rows.sort_values("layer")
    passes = [most(float(r["agree"]), float(r["agree_ci_low"])) for _, r in rows.iterrows()]
    start = next((i for i in range(len(passes)) if all(passes[i:])), None)
    return -1 if start is None else int(rows["layer"].iloc[start])


def _takeaway(result: Result) -> Takeaway | str:
    """Per lens: from which layer its top token is the model's for most prompts (the lead), then each layer's
    share from there on and its KL at that layer; or, where even the last layer does not qualify, its share."""
    t = result.table
    if not len(t):
        return ""
    b = TakeawayBuilder(key=("lens", "layer"))
    b.say("At each prompt's last token, the lens's top token is the model's top token for ")
    lenses = [(lens, rows.sort_values("layer")) for lens, rows in t.groupby("lens", sort=False)]
    words = []
    for j, (lens, rows) in enumerate(lenses):  # the lead: from which layer, per lens
        b.say("; " if j else "")
        first = int(rows["informative_from"].iloc[0])
        if first >= 0:
            words.append(b.qualify(f"most prompts from layer {first} on", "most"))
            b.say(f" through the {lens} lens")
        else:
            b.say("not ")
            words.append(b.qualify("most prompts", "not_most"))
            b.say(f" even at the last layer through the {lens} lens")
    b.say(".")
    b.end_lead()
    for j, (lens, rows) in enumerate(lenses):  # the details: the shares and KL behind each
        b.say("; " if j else f" Share of prompts by layer, {lens} lens: ")
        b.say(f"{lens} lens: " if j else "")
        first = int(rows["informative_from"].iloc[0])
        if first >= 0:
            refs = []
            for k, (_, r) in enumerate(rows[rows["layer"] >= first].iterrows()):
                b.say(", " if k else "")
                refs.append(b.quote(r, "agree", name=False, after=f" at layer {int(r['layer'])}"))
            b.refer(words[j], refs)
            b.say(" (KL(final || lens) ")
            b.quote(rows[rows["layer"] == first].iloc[0], "kl_mean", fmt=".3g", name=False,
                    after=f" nats at layer {first})")
        else:
            last = rows.iloc[-1]  # no run of layers qualifies: the last layer itself does not
            b.refer(words[j], [b.quote(last, "agree", name=False, after=f" at layer {int(last['layer'])}")])
    b.say(" (")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(").")
    _settled_words(b, t, bool(result.extra.get("jacobian_fitted")))
    return b.build()


def _settled_words(b: TakeawayBuilder, t: pd.DataFrame, fitted: bool) -> None:
    """Where the Jacobian lens is read, how settled it is: the texts it was fitted on and its largest split-half
    change over the layers compared, settled (rule `settled`) when under SETTLED, else unsettled."""
    if "split_half_change" not in t:
        return
    jac = t[t["lens"] == "jacobian"]
    known = jac[jac["split_half_change"].notna()]
    b.say(" The Jacobian lens was " + ("fitted in this run on " if fitted else "fitted on "))
    b.quote(jac.iloc[0], "fit_texts", name=False, fmt="d", interval=False, q=False, after=" texts")
    if not len(known):
        b.say("; its file records no split-half change, so how settled it is is unknown.")
        return
    worst = known.loc[known["split_half_change"].astype(float).idxmax()]
    b.say("; its matrices differ between the two halves of those texts by up to ")
    ref = b.quote(worst, "split_half_change", name=False, fmt=".2f", interval=False, q=False,
                  after=f" of their norm (layer {int(worst['layer'])})")
    b.say(": ")
    if float(worst["split_half_change"]) < SETTLED:
        b.qualify("settled at every layer compared", "settled", [ref])
        b.say(" (each under a tenth).")
    else:
        b.qualify("unsettled", "unsettled", [ref])
        b.say(" (a tenth or more), so its readout may change with more texts: fit it on more "
              "(entoscope train-lens --method jacobian) before relying on it.")
