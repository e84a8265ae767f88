"""How well a model does the built-in tasks (the `entoscope info` and report figures).

  ioi           accuracy = share of prompts whose answer logit beats the wrong name's;
                logit_diff = mean of (answer logit - wrong logit)
  facts         accuracy = share of prompts whose top-1 next token is the capital
  greater_than  prob_diff = mean of (P(years > start) - P(years <= start)) (Hanna et al. 2023)
  induction     accuracy = share of prompts whose top-1 next token continues the repeat

Every number is read at each prompt's last token, in batches, through the model layer, and comes with
its 95% bootstrap interval over prompts (`<key>_ci_low`, `<key>_ci_high`).
"""

from __future__ import annotations

from typing import Any

import torch

from .data import tasks
from .data.tokenized import make_batches, pad_id, tokenize_data
from .metrics import at_positions, logit_diff, prob_diff, top1
from .models.adapter import adapt


TASK_METRICS = {"ioi": "logit_diff", "facts": "top1", "greater_than": "prob_diff", "induction": "top1"}
_METRIC_FUNCTIONS = {"logit_diff": logit_diff, "prob_diff": prob_diff, "top1": top1}


def task_scores(model: Any, n: int = 64, seed: int = 1234, batch_size: int = 32) -> dict[str, dict[str, float]]:
    """Accuracy-style figures on `n` fresh prompts of each task (seeded), each read with its metric in
    TASK_METRICS (the metric steering's task-score side effects use too)."""
    a = adapt(model)
    out: dict[str, dict[str, float]] = {}
    for name, metric in TASK_METRICS.items():
        try:
            data = tasks.get(name, n=n, seed=seed, tokenizer=a.tokenizer)
        except ValueError as err:  # the tokenizer lacks the task's words as single tokens
            out[name] = {"skipped": 1.0, "reason": str(err)}  # type: ignore[dict-item]
            continue
        td = tokenize_data(a, data, answers=True)
        parts: list[torch.Tensor] = []
        with torch.no_grad():
            for b in make_batches(td, batch_size, pad_id(a)):
                logits = at_positions(a.run(b.tokens).logits, b.last)
                assert b.answers is not None and b.wrong_answers is not None
                parts.append(_METRIC_FUNCTIONS[metric](logits, b.answers, b.wrong_answers))
        values = torch.cat(parts)
        if metric == "logit_diff":
            out[name] = {**_mean_ci("accuracy", (values > 0).double()), **_mean_ci("logit_diff", values),
                         "n": float(len(values))}
        elif metric == "prob_diff":
            out[name] = {**_mean_ci("prob_diff", values), "n": float(len(values))}
        else:
            out[name] = {**_mean_ci("accuracy", values.double()), "n": float(len(values))}
    return out


def _mean_ci(key: str, values: torch.Tensor) -> dict[str, float]:
    """The mean over prompts with its 95% bootstrap interval (entoscope.stats defaults, seeded)."""
    from .stats import Stats, mean_stat, summarise

    x = values.double().cpu().numpy()[:, None]
    s = summarise(mean_stat(x), Stats(), seed=0)
    return {key: float(s.value[0]), f"{key}_ci_low": float(s.ci_low[0]), f"{key}_ci_high": float(s.ci_high[0])}


def format_scores(scores: dict[str, dict[str, float]]) -> str:
    lines = []
    for task, figs in scores.items():
        if "skipped" in figs:
            lines.append(f"{task:14s} skipped: {figs.get('reason')}")
            continue
        parts = [f"{k} {v:.3f}" + (f" [{figs[k + '_ci_low']:.3f}, {figs[k + '_ci_high']:.3f}]"
                                    if k + "_ci_low" in figs else "")
                 for k, v in figs.items() if k != "n" and not k.endswith(("_ci_low", "_ci_high"))]
        lines.append(f"{task:14s} " + ", ".join(parts) + f"  (n={int(figs['n'])})")
    return "\n".join(lines)
