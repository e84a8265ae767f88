"""A plan's time, estimated from one calibration forward (`entoscope ... --plan`; Operation.calibrate).

The estimate counts the model passes the plan counts, at the plan's batch size and the prompts' longest length:
one forward of a batch of the first prompts (no gradients) gives the seconds per prompt forward, and, where the
plan counts backwards, one forward with gradients and its backward the extra seconds of a prompt's backward.
seconds = forward_s x forward_passes + backward_s x backward_passes. What the passes do not cover (decoding every
layer through the unembedding, statistics, pages) is not in it: the cost table of docs/speed.md gives each
operation's time against this floor.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .data.loading import load_data
from .data.tokenized import tokenize_data
from .models.adapter import adapt
from .prepared import Plan


def calibrate_plan(plan: Plan, model: Any, data: Any, prepend_bos: bool = True) -> Plan:
    """Fill `plan.seconds` and `plan.calibration` (module docstring); a plan without prompts is left as it is."""
    a = adapt(model)
    if data is None or not (plan.forward_passes or plan.backward_passes):
        return plan
    td = tokenize_data(a, load_data(data, tokenizer=a.tokenizer), prepend_bos=prepend_bos)
    B = max(1, min(len(td), max(plan.batch_sizes or [1])))
    T = max(td.lengths)
    rows = [list(p)[:T] + [0] * (T - len(p)) for p in td.prompts[:B]]
    tokens = torch.tensor(rows, dtype=torch.long, device=a.device)
    with torch.no_grad():
        t0 = time.perf_counter()
        a.module(tokens)
        forward = (time.perf_counter() - t0) / len(rows)
    backward = 0.0
    if plan.backward_passes:
        t0 = time.perf_counter()
        out = a.module(tokens)
        out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
        out[:, -1].float().logsumexp(-1).sum().backward()
        backward = max(0.0, (time.perf_counter() - t0) / len(rows) - forward)
        a.module.zero_grad(set_to_none=True)
    plan.seconds = forward * plan.forward_passes + backward * plan.backward_passes
    plan.calibration = (f"one forward of {len(rows)} prompts x {T} tokens: {forward * 1e3:.0f} ms a prompt"
                        + (f", a backward {backward * 1e3:.0f} ms" if plan.backward_passes else "")
                        + "; the model passes only")
    return plan
