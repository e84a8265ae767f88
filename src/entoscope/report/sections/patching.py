"""The report's patching section: the IOI and greater-than circuits' patching maps (exact denoising)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ..section import Section, examples_html


COLUMNS = ["site", "value", "value_ci_low", "value_ci_high", "value_q", "significant", "value_fragile", "n_prompts"]


def _examples(quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    n = 8 if quick else 32
    return [
        ("IOI: denoising the residual stream at each name and the last token (normalised logit difference)",
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"],
                    "positions": ["IO", "S1", "S1+1", "S2", "S2+1", "END"]},
          "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("IOI: denoising each head's output (normalised logit difference)",
         {"sites": {"activation": "z", "over": ["layer", "head"]}, "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("greater-than: denoising each MLP's output at the start year (XX, YY) and the last token "
         "(normalised probability difference)",
         {"sites": {"activation": "mlp_out", "over": ["layer", "position"], "positions": ["XX", "YY", "END"]},
          "metric": "prob_diff"},
         {"task": "greater_than", "n": n, "seed": 7}),
    ]


@register("report_section", "patching")
def patching_section(model: Any, folder: Path, quick: bool) -> Section:
    """Exact denoising on IOI and greater-than; the first result is saved in `folder`, the others below it."""
    from ...patching import Patching

    body, results = examples_html(Patching, model, _examples(quick), folder, max_rows=6, columns=COLUMNS)
    heads = results[1].table
    top = heads.reindex(heads["value"].abs().sort_values(ascending=False).index).head(2)
    lead = ("On IOI, the heads whose clean output alone restores most of the logit difference: "
            + "; ".join(f"head {r.site} {r.value:.2f} [{r.value_ci_low:.2f}, {r.value_ci_high:.2f}]"
                        for r in top.itertuples())
            + f" (normalised effect, 95% intervals over {int(heads['n_prompts'].iloc[0])} prompt pairs). "
            "Each map below names its strongest cells and the ones a single prompt carries.")
    return Section("activation patching (exact, denoising)", lead, body,
                   terms=("normalised effect", "logit difference", "probability difference", "95% interval",
                          "significant", "fragile", "degenerate pair"), own_page=False)
