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


def task_scores(model: Any, n: int = 64, seed: int = 1234, batch_size: int = 32) -> dict[str, dict[str, float]]:
    """Accuracy-style figures on `n` fresh prompts of each task (seeded)."""
    a = adapt(model)
    out: dict[str, dict[str, float]] = {}
    for name in ("ioi", "facts", "greater_than", "induction"):
        try:
            data = tasks.get(name, n=n, seed=seed, tokenizer=a.tokenizer)
        except ValueError as err:  # the tokenizer lacks the task's words as single tokens
            out[name] = {"skipped": 1.0, "reason": str(err)}  # type: ignore[dict-item]
            continue
        td = tokenize_data(a, data, answers=True)
        values: dict[str, list[torch.Tensor]] = {"ld": [], "pd": [], "top1": []}
        with torch.no_grad():
            for b in make_batches(td, batch_size, pad_id(a)):
                logits = at_positions(a.run(b.tokens).logits, b.last)
                assert b.answers is not None and b.wrong_answers is not None
                values["top1"].append(top1(logits, b.answers, b.wrong_answers))
                if name == "greater_than":
                    values["pd"].append(prob_diff(logits, b.answers, b.wrong_answers))
                elif name == "ioi":
                    values["ld"].append(logit_diff(logits, b.answers, b.wrong_answers))
        if name == "ioi":
            ld = torch.cat(values["ld"])
            out[name] = {**_mean_ci("accuracy", (ld > 0).double()), **_mean_ci("logit_diff", ld), "n": float(len(ld))}
        elif name == "greater_than":
            pd_ = torch.cat(values["pd"])
            out[name] = {**_mean_ci("prob_diff", pd_), "n": float(len(pd_))}
        else:
            acc = torch.cat(values["top1"])
            out[name] = {**_mean_ci("accuracy", acc.double()), "n": float(len(acc))}
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
