"""The report's steering section: a contrastive (CAA) direction of greater-than's start year, pushed on.

The direction is the mean, over greater-than prompts, of the residual stream entering layer 2 at the last
token minus the same on each prompt's counterfactual (its start year ending in "01"; Panickssery et al.
2023 make directions from such pairs). It is added with coefficients of both signs at every position of
other greater-than prompts, and the probability difference (P(later years) - P(earlier ones)) is watched,
against a random direction of the same norm; side effects are read on the built-in tasks' prompts.

The coefficients are in units of the site's mean activation norm (`units: residual_norm`, steering/scale.py):
c = 0.1 adds a tenth of a typical residual vector's length along the direction, whatever the direction's own
norm (on SmolLM2 the mean difference is 0.78 long where the residual is some tens, so coefficients in
direction units moved nothing). The lead says material effects first, or that the effect is negligible
(docs/pages.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ...results.page import table_html
from ..preflight import runs_by
from ..section import Section, lead_of, result_html, run_saved
from ..sizes import sizes

COLUMNS = ["direction", "coefficient", "written_norm", "effect", "effect_ci_low", "effect_ci_high", "minus_random",
           "minus_random_ci_low", "minus_random_ci_high", "beats_random", "material", "negligible", "kl", "kl_ci_low",
           "kl_ci_high", "loss_change", "loss_change_ci_low", "loss_change_ci_high", "n_prompts", "n_held_out"]


def steering_config(model: Any, quick: bool) -> dict[str, Any]:
    size = sizes(model, "steering", quick)  # prompts (report/sizes.py)
    return {"direction": {"source": "mean_difference", "site": "resid_pre.2",
                          "data": {"task": "greater_than", "n": size["direction_n"], "seed": 100}},
            "coefficients": list(size["coefficients"]), "units": "residual_norm", "metric": "prob_diff",
            "side_effects": {"n": size["side_effects_n"], "seed": 1729},
            "continuations": {"prompts": size["continuation_prompts"], "tokens": 8}}


def steering_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...steering import Steering

    size = sizes(model, "steering", quick)
    return [(Steering(**steering_config(model, quick)), {"task": "greater_than", "n": size["n"], "seed": 7})]


@register("report_section", "steering")
@runs_by(steering_runs)
def steering_section(model: Any, folder: Path, quick: bool) -> Section:
    """Steer greater-than prompts along the start-year direction; the Result is saved in `folder`."""
    [(op, data)] = steering_runs(model, quick)
    result = run_saved(op, model, data, folder, folder.parent)
    t = result.table
    what = ("<p>The direction: the residual stream entering layer 2 at the last token of greater-than prompts minus "
            "the same on their counterfactuals (start year ending in 01), averaged over "
            f"{result.extra['direction'].provenance.get('n_positive', '?')} pairs (CAA); added at every position of "
            "other greater-than prompts with coefficients of both signs, in units of the residual stream's mean norm "
            f"there (R = {float(t['residual_norm'].iloc[0]):.3g} over the steered prompts' positions, the BOS left "
            f"out; the direction itself is {float(t['direction_norm'].iloc[0]):.3g} long): c = 0.1 adds a tenth of a "
            "typical residual vector. Below: the effect on the probability difference against the random direction "
            "of the same norm (the grey band: within 5% of the unsteered value, negligible), and its side "
            "effects.</p>")
    body = what + result_html(result, figures=2, lead=False, columns=COLUMNS, max_rows=len(op.coefficients) * 2)
    frame = result.extra.get("continuations")
    if frame is not None:
        body += ('<p class="figtitle">continuations (greedy, 8 tokens), unsteered and steered</p>'
                 + table_html(frame[["prompt", "unsteered"] + [c for c in frame.columns if c.startswith("direction")]]))
    return Section("steering: a contrastive direction of greater-than's start year",
                   lead_of(result, folder, folder.parent), body,
                   terms=("steering effect", "random baseline", "KL(steered || unsteered)", "loss change",
                          "probability difference", "95% interval"))
