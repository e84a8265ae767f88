"""Edge attribution patching: EAP (Syed et al. 2023) and EAP-IG (Hanna et al. 2024) edge scores.

For an edge s -> r, over clean/corrupt prompt pairs:

    score(s -> r) = sum over positions of (s_corrupt - s_clean) . g(r),   averaged over prompts

where s_clean, s_corrupt are sender s's outputs on the clean and on the corrupt prompt, and g(r) is
the gradient of the metric with respect to receiver r's PRE-NORM input (what r reads: the sum of
its senders' outputs):
- EAP:    g(r) = d metric / d input(r) on the clean run. The score is the first-order estimate of
          metric(edge patched to its corrupt value) - metric(clean): negative when patching hurts.
- EAP-IG: g(r) = sum_k w_k d metric / d input(r), each gradient taken on a run whose INPUT (the
          embeddings entering block 0, resid_pre.0) is corrupt + alpha_k (clean - corrupt); the
          rest of the model runs normally from there (EAP-IG-inputs). Rules (alpha_k, w_k), m steps:
            left      alpha = k/m,       k = 0..m-1, w = 1/m (default, as EAP-IG-inputs: starts at
                      the corrupt input, never evaluates the clean end)
            right     alpha = k/m,       k = 1..m,   w = 1/m (m = 1: exactly EAP)
            midpoint  alpha = (k+1/2)/m, k = 0..m-1, w = 1/m
            trapezoid alpha = k/m,       k = 0..m,   w = 1/m, halved at both ends (m + 1 runs)
          As m grows, the scores of the edges out of `input` add up to metric(corrupt) -
          metric(clean) (the completeness of integrated gradients along the input path).
One backward pass per step gives the gradient for every receiver at once (closed-form norm VJPs,
see entoscope.models.split_inputs); several steps share a pass, stacked along the batch. The metric is read at each prompt's last token; padding
positions contribute nothing (their gradient is zero in a causal model, and they are masked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from ..data.tokenized import Batch
from ..metrics import at_positions
from ..models.adapter import Intervention, ModelAdapter
from ..models.footprint import Footprint
from ..models.names import ActName
from ..models.split_inputs import (EdgeGradients, final_residual, gradient_reads,
                                   sender_outputs, sender_reads)
from ..operation import progress

Rule = Literal["left", "right", "midpoint", "trapezoid"]
MetricFn = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def ig_points(steps: int, rule: Rule) -> list[tuple[float, float]]:
    """(alpha, weight) of each gradient evaluation; weights sum to 1."""
    m = steps
    if m < 1:
        raise ValueError("steps must be >= 1")
    if rule == "left":
        return [(k / m, 1 / m) for k in range(m)]
    if rule == "right":
        return [(k / m, 1 / m) for k in range(1, m + 1)]
    if rule == "midpoint":
        return [((k + 0.5) / m, 1 / m) for k in range(m)]
    if rule == "trapezoid":
        return [(k / m, (0.5 if k in (0, m) else 1.0) / m) for k in range(m + 1)]
    raise ValueError(f"unknown rule {rule!r}")


def _grad_names(model: ModelAdapter) -> list[ActName]:
    s = model.structure
    names = [ActName(kind, L) for L in range(s.n_layers) for kind in ("q", "k", "v", "mlp_in")]
    return names + [final_residual(s)]


def _position_mask(batch: Batch, T: int) -> Tensor:
    return (torch.arange(T)[None, :] < batch.lengths[:, None]).float()  # [B, T]


def batch_scores(model: ModelAdapter, batch: Batch, metric: MetricFn,
                 points: Sequence[tuple[float, float]] | None, rows_per_pass: int = 32) -> Tensor:
    """Each of this batch's prompts' edge scores: [B, n_senders, n_receivers] (dense; mask it).
    points None: EAP (the clean run's gradient); else EAP-IG at those (alpha, weight). Several points
    share one forward and backward pass (stacked along the batch) up to `rows_per_pass` rows."""
    assert batch.cf_tokens is not None and batch.answers is not None and batch.wrong_answers is not None
    B = len(batch)
    last = batch.last
    answers, wrong = batch.answers.to(model.device), batch.wrong_answers.to(model.device)
    both = model.run(torch.cat([batch.tokens, batch.cf_tokens]), sender_reads(model.structure))  # clean, corrupt
    reference = at_positions(both.logits[:B], last).detach()
    x_clean, x_corrupt = both[ActName("resid_pre", 0)][:B], both[ActName("resid_pre", 0)][B:]
    with torch.no_grad():
        senders = sender_outputs(model, both.acts)
        delta = senders[B:] - senders[:B]  # [B, T, S, d]: corrupt - clean
        delta *= _position_mask(batch, delta.shape[1]).to(delta.device)[:, :, None, None]
    del both, senders
    reads = gradient_reads(model.structure)
    names = _grad_names(model)
    sums = EdgeGradients(model, delta)
    pts = list(points) if points is not None else [(1.0, 1.0)]
    per_pass = max(1, rows_per_pass // B)
    for start in range(0, len(pts), per_pass):
        chunk = pts[start:start + per_pass]
        k = len(chunk)
        ivs = []
        if points is not None:
            alphas = torch.tensor([a for a, _ in chunk], device=x_clean.device, dtype=x_clean.dtype)
            inputs = x_corrupt[None] + alphas[:, None, None, None] * (x_clean - x_corrupt)[None]
            ivs.append(Intervention.replace(ActName("resid_pre", 0), inputs.reshape(k * B, *x_clean.shape[1:])))
        out = model.run(batch.tokens.repeat(k, 1), reads, interventions=ivs, grad=True)
        logits, kept = out.logits, out.acts
        values = metric(at_positions(logits, last.repeat(k)), answers.repeat(k, 1), wrong.repeat(k, 1),
                        reference.repeat(k, 1))
        row_weights = torch.tensor([w for _, w in chunk], device=values.device).repeat_interleave(B)
        tensors = [kept[n] for n in names]
        grads = torch.autograd.grad((values * row_weights).sum(), tensors, allow_unused=True)
        gmap = {n: (g if g is not None else torch.zeros_like(t)) for n, t, g in zip(names, tensors, grads)}
        sums.add({n: v.detach() for n, v in kept.items()}, gmap)
        del logits, kept, tensors, grads, gmap
    return sums.result()


def edge_scores(model: ModelAdapter, batches: Sequence[Batch], metric: MetricFn, *,
                method: Literal["eap", "eap_ig"] = "eap_ig", steps: int = 5, rule: Rule = "left",
                rows_per_pass: int = 32, quiet: bool = False) -> Tensor:
    """EAP or EAP-IG edge scores, [n_senders, n_receivers], averaged over prompts (dense: entries for
    pairs that are not edges are meaningless; mask with the graph). EAP ignores steps and rule.
    `rows_per_pass` bounds the prompts x integration points of one forward/backward pass."""
    return edge_scores_per_prompt(model, batches, metric, method=method, steps=steps, rule=rule,
                                  rows_per_pass=rows_per_pass, quiet=quiet).mean(0)


def edge_scores_per_prompt(model: ModelAdapter, batches: Sequence[Batch], metric: MetricFn, *,
                           method: Literal["eap", "eap_ig"] = "eap_ig", steps: int = 5, rule: Rule = "left",
                           rows_per_pass: int = 32, quiet: bool = False) -> Tensor:
    """Every prompt's edge scores, [n_prompts, n_senders, n_receivers], in dataset order (ascending batch
    `index`): what the dataset-level scores, their intervals and circuit stability are computed from."""
    points = ig_points(steps, rule) if method == "eap_ig" else None
    parts, order = [], []
    for b in progress(batches, total=len(batches), desc="edge scores", quiet=quiet):
        parts.append(batch_scores(model, b, metric, points, rows_per_pass).cpu())
        order += list(b.index)
    stacked = torch.cat(parts)
    return stacked[torch.argsort(torch.tensor(order))]  # ascending dataset index


def gradient_pass_bytes(model: ModelAdapter, n_senders: int, T: int, method: str, steps: int,
                        rule: Rule, rows_per_pass: int = 32) -> Callable[[int], int]:
    """EAP's and EAP-IG's gradient passes (eap.batch_scores) for a batch of b prompts, in bytes: the senders'
    corrupt - clean deltas [b, T, senders, d_model] (float32, kept through the batch), and one pass of k x b rows
    (k the integration points stacked in it: rows_per_pass // b of them, at most all of them; EAP: 1): what
    autograd saves for the backward (the weights require gradients: models/footprint.saved), the logits at every
    position and their gradient, and the gradients of the receivers' reads (q, k, v, the MLPs' inputs and the
    final residual). The other phases (the clean and corrupt reads, an edge patcher's runs) are per_example's."""
    if method not in ("eap", "eap_ig"):
        return lambda b: 0
    fp = Footprint(model)
    points = len(ig_points(steps, rule)) if method == "eap_ig" else 1
    grads = fp.act(_grad_names(model), 1, T)

    def gradient(b: int) -> int:
        rows = min(points, max(1, rows_per_pass // b)) * b
        return b * T * n_senders * model.structure.d_model * 4 + fp.saved(rows, T) + fp.logits(rows * T) \
            + rows * grads

    return gradient
