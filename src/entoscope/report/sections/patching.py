"""The report's patching section: the IOI and greater-than circuits' patching maps (exact denoising).

On a large model (report/sizes.py) the maps are attribution patching's (one forward and backward a pair
gives every cell: the first-order estimate of exact patching), on more pairs than exact patching's sweeps
could afford in the report's time; the title and takeaway say so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ...results.claims import TakeawayBuilder, most
from ..preflight import runs_by
from ..section import Section, examples_html
from ..sizes import sizes


COLUMNS = ["site", "value", "value_ci_low", "value_ci_high", "value_q", "significant", "value_fragile", "n_prompts"]


def _examples(model: Any, quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    size = sizes(model, "patching", quick)  # prompt pairs and method (report/sizes.py)
    n, method = size["n"], size["method"]
    return [
        ("IOI: denoising the residual stream at each name and the last token (normalised logit difference)",
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"],
                    "positions": ["IO", "S1", "S1+1", "S2", "S2+1", "END"]},
          "metric": "logit_diff", "method": method},
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
    """Exact denoising on IOI and greater-than; the first result is saved in `folder`, the others below it."""
    from ...patching import Patching

    examples = _examples(model, quick)
    exact = examples[0][1]["method"] == "exact"
    if not exact:  # the titles name the method
        examples = [(title.replace("denoising", "attribution patching (denoising)", 1), config, data)
                    for title, config, data in examples]
    body, results = examples_html(Patching, model, examples, folder, max_rows=6, columns=COLUMNS)
    heads = results[1].table
    b = TakeawayBuilder(source=f"{folder.name}/example1/table.csv", key="site")
    if not exact:
        b.say("By attribution patching (the first-order estimate of exact patching): ")
    ranked = heads.reindex(heads["value"].abs().sort_values(ascending=False, kind="stable").index)
    best = ranked.iloc[0]
    if most(best["value"], best.get("value_ci_low")):
        b.say("On IOI, one head's clean output patched into the corrupt run restores ")
        word_most = b.qualify("most", "most")
        b.say(" of the logit difference: ")
        refs = [b.quote(best, "value")]
        b.refer(word_most, refs)
        b.say("; the next ")
        word = b.qualify("largest", "top_by_abs")
        b.say(" effect: ")
        b.refer(word, refs + [b.quote(ranked.iloc[1], "value")])
    else:
        b.say("On IOI, ")
        none = b.qualify("no single head restores most", "none_most")
        b.say(" of the logit difference when its clean output is patched into the corrupt run; the ")
        word = b.qualify("largest", "top_by_abs")
        b.say(" normalised effects: ")
        refs = b.ranking(ranked, "value", 2)
        b.refer(none, refs[:1])
        b.refer(word, refs)
    b.say(" (")
    b.constant(heads["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" intervals over ")
    b.constant(heads["n_prompts"].iloc[0], "n_prompts", unit="prompt pairs")
    b.say("). Each map below has its own takeaway.")
    terms = ("normalised effect", "logit difference", "probability difference", "95% interval", "significant",
             "q-value", "fragile", "degenerate pair", "names")
    return Section(f"activation patching ({'exact' if exact else 'attribution'}, denoising)", b.build(), body,
                   terms=terms if exact else ("attribution patching",) + terms, own_page=False)
