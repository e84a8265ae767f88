"""The patching section of `entoscope report`: the IOI and greater-than circuits' patching maps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..registry import register


def _examples(quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    n = 8 if quick else 32
    return [
        ("IOI: denoising the residual stream, last 10 positions (normalised logit difference)",
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"], "positions": "-10:"},
          "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("IOI: denoising each head's output (normalised logit difference)",
         {"sites": {"activation": "z", "over": ["layer", "head"]}, "metric": "logit_diff"},
         {"task": "ioi", "n": n, "seed": 7}),
        ("greater-than: denoising each MLP's output, last 6 positions (normalised probability difference)",
         {"sites": {"activation": "mlp_out", "over": ["layer", "position"], "positions": "-6:"},
          "metric": "prob_diff"},
         {"task": "greater_than", "n": n, "seed": 7}),
    ]


@register("report_section", "patching")
def patching_section(model: Any, folder: Path, quick: bool) -> tuple[str, str]:
    """Exact denoising on IOI and greater-than; the first result is saved in `folder`, the others below it."""
    from ..report import examples_html
    from .operation import Patching

    html = examples_html(Patching, model, _examples(quick), folder, max_rows=6)
    return ("activation patching (exact, denoising)", html)
