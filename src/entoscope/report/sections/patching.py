"""The report's patching section: the IOI and greater-than circuits' patching maps (denoising).

1. IOI, the residual stream at each name and the last token, by layer: always exact patching (on a large model
   at a few layers spread from the first to the last, report/sizes.py), because this map says where the
   answer's information sits, and a first-order estimate is least trustworthy exactly there (a whole
   residual vector swapped is no small change). The lead says, per layer, which position's patch restores
   the most (`leading_positions`).
2. IOI, each head's output; 3. greater-than, each MLP's output at the start year and the last token. On a
   large model these are attribution patching's (one forward and backward a pair gives every cell: the
   first-order estimate of exact patching), on more pairs than exact sweeps could afford in the report's
   time, and each map's top cells are re-checked by exact patching on the same pairs (patching/recheck.py):
   both are shown, estimates outside [0, 1] flagged, and the lead names the heads whose exact effect holds
   before the ones whose does not.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...registry import register
from ...results.claims import TakeawayBuilder, most
from ...results.page import table_html
from ..preflight import runs_by
from ..section import Section, result_html
from ..sizes import sizes

COLUMNS = ["site", "value", "value_ci_low", "value_ci_high", "value_q", "significant", "value_fragile", "n_prompts"]
RECHECK_COLUMNS = ["site", "estimate", "estimate_ci_low", "estimate_ci_high", "estimate_q", "outside_range", "value",
                   "value_ci_low", "value_ci_high", "held", "n_prompts"]
RECHECK_TITLE = "exact re-check of the top cells"


def _examples(model: Any, quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    size = sizes(model, "patching", quick)  # prompt pairs, methods, layers (report/sizes.py)
    n, method = size["n"], size["method"]
    at = "" if size["layers"] == "all" else f" (layers {', '.join(map(str, size['layers']))})"
    return [
        ("IOI: exact denoising of the residual stream at each name and the last token (normalised logit "
         "difference)" + at,
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"], "layers": size["layers"],
                    "positions": list(size["positions"])},
          "metric": "logit_diff", "method": "exact"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("IOI: denoising each head's output (normalised logit difference)",
         {"sites": {"activation": "z", "over": ["layer", "head"]}, "metric": "logit_diff", "method": method},
         {"task": "ioi", "n": n, "seed": 7}),
        ("greater-than: denoising each MLP's output at the start year (XX, YY) and the last token "
         "(normalised probability difference)",
         {"sites": {"activation": "mlp_out", "over": ["layer", "position"], "positions": ["XX", "YY", "END"]},
          "metric": "prob_diff", "method": method},
         {"task": "greater_than", "n": n, "seed": 7}),
    ]


def patching_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...patching import Patching

    return [(Patching(**config), data) for _, config, data in _examples(model, quick)]


@register("report_section", "patching")
@runs_by(patching_runs)
def patching_section(model: Any, folder: Path, quick: bool) -> Section:
    """Denoising on IOI and greater-than; the first result is saved in `folder`, the others below it, each
    attribution map with its exact re-check (recheck.csv beside its table)."""
    from ...patching import Patching
    from ...patching.recheck import recheck_note, recheck_operation, recheck_table

    examples = _examples(model, quick)
    k = sizes(model, "patching", quick)["recheck"]
    exact = examples[1][1]["method"] == "exact"
    if not exact:  # the titles name the method
        examples = [(title.replace("denoising", "attribution patching (denoising)", 1), config, data)
                    if config["method"] != "exact" else (title, config, data) for title, config, data in examples]
    parts, results, rechecks = [], [], []
    for i, (title, config, data) in enumerate(examples):
        where = folder if i == 0 else folder / f"example{i}"
        op = Patching(**config)
        result = op.run(model, data, quiet=True)
        recheck = None
        again = recheck_operation(op, result.table, k) if op.method != "exact" and k else None
        if again is not None:
            recheck = recheck_table(result.table, again.run(model, data, quiet=True).table, k,
                                    normalized=op.comparison == "normalized")
            result.notes.append((RECHECK_TITLE, recheck_note(recheck)))
            result.tables["recheck"] = recheck
            result.shown_tables.append((RECHECK_TITLE, "recheck"))
        result.save(where, assets_dir=folder.parent)
        results.append(result)
        rechecks.append(recheck)
        rel = f"{folder.name}/index.html" if i == 0 else f"{folder.name}/{where.name}/index.html"
        body = result_html(result, max_rows=6, columns=COLUMNS)
        if recheck is not None:
            body += (f'<p class="figtitle">{RECHECK_TITLE}: {html.escape(recheck_note(recheck))}</p>'
                     + table_html(recheck[[c for c in RECHECK_COLUMNS if c in recheck]]))
        link = f'<p class="more"><a href="{rel}">{html.escape(title)}: every figure and the whole table</a></p>'
        parts.append(f"<h3>{html.escape(title)}</h3>" + body + link)
    lead = _lead(folder.name, results, rechecks)
    terms = ("normalised effect", "logit difference", "probability difference", "95% interval", "significant",
             "q-value", "fragile", "degenerate pair", "names")
    method = "exact" if exact else "exact and attribution"
    return Section(f"activation patching ({method}, denoising)", lead, "".join(parts),
                   terms=terms if exact else ("attribution patching",) + terms, own_page=False)


def leading_positions(t: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Runs of consecutive layers (of those in the table) in which one position's cell is the layer's largest
    and its interval lies above 0: [(position, its rows of the run, by layer)]. A layer whose largest cell's
    interval reaches 0 ends a run and starts none."""
    runs: list[tuple[str, list[Any]]] = []
    for layer, rows in t.sort_values("layer").groupby("layer", sort=True):
        best = rows.loc[rows["value"].astype(float).idxmax()]
        if not float(best["value_ci_low"]) > 0:
            runs.append(("", []))
            continue
        if runs and runs[-1][0] == best["position"]:
            runs[-1][1].append(best)
        else:
            runs.append((str(best["position"]), [best]))
    return [(p, pd.DataFrame(rows)) for p, rows in runs if p]


def _where(b: TakeawayBuilder, t: pd.DataFrame, source: str) -> None:
    """Where the answer's information sits: per run of layers, the position whose patch restores the most."""
    runs = leading_positions(t)
    if not runs:
        b.say("On IOI, no position's clean residual stream, patched in alone, brings the logit difference back by an "
              "amount whose interval lies above zero at any layer patched")
        return
    b.say("On IOI, the position whose clean residual stream, patched in alone, brings the logit difference back "
          "best is ")
    for i, (position, rows) in enumerate(runs):
        b.say(", then " if i else "")
        word = b.qualify(position, "leads_layers", condition=f"position={position}")
        first, last = rows.iloc[0], rows.iloc[-1]
        b.say(" (")
        refs = [b.quote(first, "value", source=source)]
        if len(rows) > 1:
            b.say(" to ")
            refs.append(b.quote(last, "value", source=source))
        b.say(")")
        b.refer(word, refs)


def _lead(name: str, results: list[Any], rechecks: list[Any]) -> Any:
    """The lead: where the answer's information sits (positions) and the heads' headline (one restores most, none
    does, or how many attribution's top heads hold when re-checked exactly); the details: the heads' figures, the
    interval level, what the positions' rule means."""
    b = TakeawayBuilder(key="site")
    _where(b, results[0].table, f"{name}/table.csv")
    b.say(". ")
    heads, recheck = results[1].table, rechecks[1]
    source = f"{name}/example1/table.csv"
    if recheck is not None:
        fdr = float(((results[1].manifest or {}).get("config", {}).get("stats") or {}).get("fdr", 0.05))
        _rechecked_heads(b, recheck, f"{name}/example1/recheck.csv", fdr)
    else:
        _exact_heads(b, heads, source)
    b.say(" (")
    b.constant(heads["ci_level"].iloc[0], "ci_level", fmt=".0%", source=source)
    b.say(" intervals over ")
    b.constant(heads["n_prompts"].iloc[0], "n_prompts", unit="prompt pairs", source=source)
    b.say(").")
    if leading_positions(results[0].table):
        b.say(" A position named above leads at each layer from its first cell named to its last: that position's "
              "cell is the layer's top one and its interval lies above zero, so the answer's information sits there "
              "over those layers.")
    b.say(" Each map below has its own takeaway.")
    return b.build()


def _exact_heads(b: TakeawayBuilder, heads: pd.DataFrame, source: str) -> None:
    ranked = heads.reindex(heads["value"].abs().sort_values(ascending=False, kind="stable").index)
    best = ranked.iloc[0]
    if most(best["value"], best.get("value_ci_low")):
        b.say("One head's clean output patched into the corrupt run ")
        word_most = b.qualify("restores most", "most")
        b.say(" of the logit difference: ")
        refs = [b.quote(best, "value", source=source)]
        b.refer(word_most, refs)
        b.say(".")
        b.end_lead()
        b.say(" The next ")
        word = b.qualify("largest", "top_by_abs")
        b.say(" effect: ")
        b.refer(word, refs + [b.quote(ranked.iloc[1], "value", source=source)])
    else:
        none = b.qualify("No single head restores most", "none_most")
        b.say(" of the logit difference when its clean output is patched into the corrupt run.")
        b.end_lead()
        b.say(" The ")
        word = b.qualify("largest", "top_by_abs")
        b.say(" normalised effects: ")
        refs = b.ranking(ranked, "value", 2, source=source)
        b.refer(none, refs[:1])
        b.refer(word, refs)


def _rechecked_heads(b: TakeawayBuilder, recheck: pd.DataFrame, source: str, fdr: float) -> None:
    """Attribution's top heads by their exact re-check: those that hold first (those the screen's false discovery
    control also kept before those it did not), then the others."""
    held = recheck[recheck["held"].astype(bool)]
    held = held.iloc[np.argsort((held["estimate_q"].to_numpy(float) > fdr), kind="stable")]
    rest = recheck[~recheck["held"].astype(bool)]
    b.say("Attribution patching's top heads by |estimate|, re-checked by exact patching on the same pairs: ")
    b.count(len(held), len(recheck), "held", unit="hold", source=source)
    b.say(".")
    b.end_lead()
    for i, (_, row) in enumerate(held.iterrows()):
        b.say(" Held: " if i == 0 else ", ")
        _both(b, row, source)
    if len(rest):
        b.say("; not held (the exact interval reaches zero, or lies on the other side): " if len(held) else
              " Not held (the exact interval reaches zero, or lies on the other side): ")
        for i, (_, row) in enumerate(rest.iterrows()):
            b.say(", " if i else "")
            _both(b, row, source)
    flagged = recheck[recheck["outside_range"].astype(bool)]
    if len(flagged):
        b.say("; ")
        b.count(len(flagged), len(recheck), "outside_range", unit="estimates", source=source)
        b.say(" lie outside the span from the corrupt run to the clean one, where a first-order estimate "
              "extrapolates (flagged in the re-check's table, their exact values beside them)")


def _both(b: TakeawayBuilder, row: Any, source: str) -> None:
    b.quote(row, "value", source=source, name=f"{row['site']} exact")
    b.say(" (estimate ")
    b.quote(row, "estimate", source=source, name=False)
    b.say(")")
