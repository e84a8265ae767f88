"""The report's lens section: the logit lens on IOI prompts, by layer, at the last positions; then the logit
lens beside a Jacobian lens fitted here on a small built-in corpus (lens/compare.py), on the same prompts'
last tokens: per layer, the share of prompts whose lens top token is the model's and the KL to the final
distribution, and from which layer each lens is informative. The report trains no tuned lens, so the
comparison has none. The fit's texts and length follow the model's cost (report/sizes.py); where the budget
buys too few positions the section fits no Jacobian lens and says so."""

from __future__ import annotations

import html
import tempfile
from pathlib import Path
from typing import Any

from ...registry import register
from ...results.claims import join
from ..preflight import runs_by
from ..section import Section, lead_of, result_html, run_saved
from ..sizes import sizes


def lens_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...lens import Lens
    from ...sites import Sites

    op = Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions="-8:"))
    return [(op, {"task": "ioi", "n": sizes(model, "lens", quick)["n"], "seed": 7})]


@register("report_section", "lens")
@runs_by(lens_runs)
def lens_section(model: Any, folder: Path, quick: bool) -> Section:
    from ...data import tasks
    from ...lens import JacobianLens
    from ...lens.compare import compare_lenses

    [(op, ioi)] = lens_runs(model, quick)
    size = sizes(model, "lens", quick)
    result = run_saved(op, model, ioi, folder, folder.parent)
    if not size["jacobian_fit"]:
        note = (f'<p class="note">No Jacobian lens in this report: its fit ({size["jacobian_texts"]} texts) would '
                f"have {size['jacobian_max_length'] - size['jacobian_skip_first']} positions a text within the "
                f"{'quick ' if quick else ''}report's budget of {size['jacobian_budget_macs']:.2g} multiply-adds for "
                "this model (report/sizes.py), too few to fit on. Run the full report, or fit one with "
                "<code>entoscope train-lens --method jacobian</code> and compare with lens/compare.py.</p>")
        return Section("logit lens on IOI (last 8 positions)", lead_of(result, folder, folder.parent),
                       result_html(result, lead=False) + note,
                       terms=("logit lens", "KL(final || lens)", "95% interval", "names"))
    # a Jacobian lens fitted on a few corpus texts (seconds on the demo model), compared on the same IOI prompts
    # built without the model's tokenizer: the texts are only text, so a tokenizer that splits the tasks' answer
    # words (SmolLM2's digits) does not refuse them as it would a task's answer set
    corpus = tasks.corpus(n=size["jacobian_texts"], seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        fitted = JacobianLens.fit(model, corpus, skip_first=size["jacobian_skip_first"],
                                  max_length=size["jacobian_max_length"], quiet=True)
        fitted.save(Path(tmp) / "jacobian")
        compared = compare_lenses(model, ioi, jacobian=str(Path(tmp) / "jacobian"))
    where = folder / "comparison"
    compared.save(where, assets_dir=folder.parent)
    lead = join([lead_of(result, folder, folder.parent), lead_of(compared, where, folder.parent)])  # leads, details
    fit = (f'<p class="note">The Jacobian lens was fitted here on {size["jacobian_texts"]} texts of the built-in '
           f"corpus cut to {size['jacobian_max_length']} tokens, the first {size['jacobian_skip_first']} positions "
           "left out (the sizes this model's cost allows, report/sizes.py).</p>")
    link = f'<p class="more"><a href="{folder.name}/comparison/index.html">the lenses side by side: every figure and ' \
           "the whole table</a></p>"
    body = result_html(result, lead=False) + "<h3>" + html.escape(compared.title) + "</h3>" + fit + \
        result_html(compared, lead=False, figures=0, max_rows=40) + link
    return Section("logit lens on IOI (last 8 positions), and beside a Jacobian lens", lead, body,
                   terms=("logit lens", "Jacobian lens", "KL(final || lens)", "95% interval", "names"))
