"""The report's probing section: two properties of the demo tasks, probed by layer.

1. greater-than: the start year's last two digits (the task's `label`, 0-99: regression) at the last
   positions of the residual stream. The model must carry them to the final token to say which
   years are greater; at layer 0 (the embeddings) the last tokens hold no trace of them.
2. IOI: the order of the names (`label`: 0 = ABBA, 1 = BABA) at the last token, 5-fold, with the
   causal check (the direction projected out at the best layer, logit difference watched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...registry import register
from ...results.claims import join
from ..preflight import runs_by
from ..section import Section, examples_html
from ..sizes import sizes


def _examples(model: Any, quick: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    size = sizes(model, "probing", quick)  # prompts and layers (report/sizes.py)
    at = "" if size["layers"] == "all" else f" (layers {', '.join(map(str, size['layers']))})"
    return [
        ("greater-than: the start year's two digits (regression, held-out R^2) by layer and position" + at,
         {"sites": {"activation": "resid_pre", "over": ["layer", "position"], "positions": "-3:",
                    "layers": size["layers"]},
          "causal_check": {"metric": "prob_diff", "top": 1}},
         {"task": "greater_than", "n": size["greater_than_n"], "seed": 11}),
        ("IOI: which name comes first (ABBA / BABA) at the last token, 5-fold" + at,
         {"sites": {"activation": "resid_post", "over": ["layer"], "layers": size["layers"]}, "split": "kfold",
          "k": 5,
          "causal_check": {"metric": "logit_diff", "top": 1}},
         {"task": "ioi", "n": size["ioi_n"], "seed": 11}),
    ]


def probing_runs(model: Any, quick: bool) -> list[tuple[Any, Any]]:
    from ...probing import Probing

    return [(Probing(**config), data) for _, config, data in _examples(model, quick)]


@register("report_section", "probing")
@runs_by(probing_runs)
def probing_section(model: Any, folder: Path, quick: bool) -> Section:
    """Probe the model for two task properties; the first Result is saved in `folder`, the other below it."""
    from ...probing import Probing

    body, results = examples_html(Probing, model, _examples(model, quick), folder, max_rows=12)
    lead = join([r.takeaway for r in results], labels=["Greater-than start year: ", "IOI name order: "],
                prefixes=[folder.name if i == 0 else f"{folder.name}/example{i}" for i in range(len(results))])
    return Section("probing: held-out scores against a control task, by layer", lead, body,
                   terms=("held-out score", "causal check", "names"), own_page=False)

