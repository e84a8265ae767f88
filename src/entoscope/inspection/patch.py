"""`es.inspect` with a counterfactual: exact activation patching of resid_pre over layer x position for the one
pair, by the patching operation itself (patching/operation.py: its checks, its schedule of patched runs that
start part-way, its metric).

Denoising (Meng et al. 2022's causal tracing; Heimersheim & Nanda 2024, "How to use and interpret activation
patching"): the counterfactual prompt runs, and resid_pre of layer L at position p is set to its value in the
prompt's run. Per cell: `patched`, the metric of that run, and `normalized` = (patched - corrupt) / (clean -
corrupt), 1 where the cell alone restores the prompt's metric and 0 where it changes nothing (blank when the
two runs' metrics are equal). The metric is the logit difference answer - wrong, or the answer's logit without
a wrong answer. Without an answer, the answer is the model's own top prediction on the prompt and the wrong
answer (when none is given) the counterfactual's top prediction, where it differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..data.examples import Dataset, Example
from ..metrics import Metric
from ..models.adapter import ModelAdapter
from ..models.vocabulary import Vocabulary
from ..patching.operation import Patching
from ..prepared import Prepared
from ..sites import Sites
from ..stats import Stats

STAND_IN = 0  # the answer id a plan uses before the model's own prediction is known (the schedule ignores it)


def patching_op(metric: str, batch_size: int | None, memory: int | str, prepend_bos: bool,
                answer_scoring: str) -> Patching:
    """The patching operation one inspection runs (no intervals: one pair has nothing to resample)."""
    return Patching(method="exact", sites=Sites(activation="resid_pre", over=["layer", "position"]),
                    metric=Metric(type=metric), comparison="difference", stats=Stats(n_boot=0), per_prompt=False,
                    batch_size=batch_size, memory=memory, prepend_bos=prepend_bos,
                    answer_scoring=answer_scoring)  # type: ignore[arg-type]


def prepare_patching(model: ModelAdapter, op: Patching, prompt: Any, counterfactual: Any,
                     answers: Sequence[Any], wrong: Sequence[Any]) -> Prepared[Any]:
    """The patching operation prepared on the pair (every check it makes, the schedule, the plan)."""
    example = Example(prompt, counterfactual, answers=tuple(answers), wrong_answers=tuple(wrong))
    return op.prepare(model, Dataset("inspect", (example,)))


def run_patching(op: Patching, prepared: Prepared[Any], vocab: Vocabulary, tokens: Sequence[int],
                 cf_tokens: Sequence[int], quiet: bool = True) -> tuple[pd.DataFrame, dict[str, float]]:
    """One row per (layer, position): the patched metric and its normalised value; and the two runs' metrics."""
    st = prepared.state
    shard = op.execute_shard(prepared, "main", list(range(len(st.chunks))), quiet=quiet)
    patched = np.asarray(shard.arrays["patched"], dtype=np.float64)[0]  # [units]
    clean, corrupt = float(shard.arrays["m_source"][0]), float(shard.arrays["m_base"][0])
    units = st.siteset.units
    layer = np.array([u.get("layer") for u in units], dtype=np.int64)
    pos = np.array([u.get("pos") for u in units], dtype=np.int64)
    gap = clean - corrupt
    normalized = (patched - corrupt) / gap if abs(gap) > op.min_gap else np.full_like(patched, np.nan)
    frame = pd.DataFrame({"site": [u.label for u in units], "layer": layer, "position": pos,
                          "token": list(vocab.take(np.asarray(tokens)[pos])),
                          "counterfactual_token": list(vocab.take(np.asarray(cf_tokens)[pos])),
                          "patched": patched, "normalized": normalized})
    return frame, {"clean": clean, "corrupt": corrupt, "metric": op.metric.type}
