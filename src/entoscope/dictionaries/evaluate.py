"""How good a dictionary is: reconstruction on held-out tokens, and the model's loss with it spliced in.

quality:        L0 = mean number of active features per token; explained variance = 1 - sum ||x_out -
                x_hat||^2 / sum ||x_out - mean(x_out)||^2; dead = fraction of features that never fire.
loss_recovered: the reconstruction replaces the written activation (the error dropped) at every position
                but the first (BOS, left out of training too); recovered = (L_zero - L_spliced) /
                (L_zero - L_clean), L_zero with the activation zeroed at those positions (SAELens's "CE loss
                score"). Two losses: next-token cross-entropy over every position, and, with datasets that
                have answers, the answer loss -log(sum of the answers' probabilities) at each prompt's last
                position. On the demo's task prompts most positions are unpredictable (names, random tokens),
                so the answer loss is the one that says whether the model still does its tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import make_batches, pad, pad_id, tokenize_data
from ..metrics import at_positions, readable
from ..models.adapter import Intervention, adapt
from ..models.dictionaries.dictionary import Dictionary


def quality(d: Dictionary, x_in: Tensor, x_out: Tensor) -> dict[str, float]:
    """L0, explained variance, dead fraction and MSE of a dictionary on rows x_in -> x_out."""
    with torch.no_grad():
        f = d.encode(x_in)
        recon = d.decode(f)
        resid = (x_out - recon).pow(2).sum()
        total = (x_out - x_out.mean(0)).pow(2).sum()
        fired = (f > 0).any(0)
    return {"l0": float((f > 0).sum(-1).float().mean()), "explained_variance": float(1 - resid / total),
            "dead_fraction": float(1 - fired.float().mean()), "mse_per_token": float(resid / len(x_out)),
            "tokens": int(len(x_out))}


def next_token_loss(model: Any, prompts: list[list[int]], interventions: Sequence[Intervention] = (),
                    batch: int = 64) -> float:
    """Mean next-token cross-entropy over every real position of `prompts` (position 0 predicts 1, ...)."""
    m = adapt(model)
    total, count = 0.0, 0
    for start in range(0, len(prompts), batch):
        tokens, lengths = pad(prompts[start:start + batch], pad_id(m))
        with torch.no_grad():
            logits = readable(m.run(tokens, interventions=interventions).logits).cpu()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        real = torch.arange(1, tokens.shape[1])[None, :] < lengths[:, None]
        total += float(-(logp * real).sum())
        count += int(real.sum())
    return total / max(1, count)


def answer_loss(model: Any, datasets: list[Dataset], interventions: Sequence[Intervention] = (),
                batch: int = 64) -> float:
    """Mean over prompts of -log(sum of the answers' probabilities) at the prompt's last position."""
    m = adapt(model)
    total, count = 0.0, 0
    for data in datasets:
        td = tokenize_data(m, data, answers=True)
        for b in make_batches(td, batch, pad_id(m)):
            with torch.no_grad():
                logits = readable(at_positions(m.run(b.tokens, interventions=interventions).logits, b.last)).cpu()
            assert b.answers is not None
            logp = torch.log_softmax(logits, dim=-1).gather(1, b.answers.clamp(min=0))
            logp = logp.masked_fill(b.answers < 0, -torch.inf)
            total += float(-torch.logsumexp(logp, dim=1).sum())
            count += len(b)
    return total / max(1, count)


def _past_bos(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda x: torch.cat([x[:, :1], fn(x)[:, 1:].to(x.dtype)], dim=1)


def loss_recovered(model: Any, d: Dictionary, prompts: list[list[int]],
                   answered: list[Dataset] | None = None) -> dict[str, float]:
    """Losses clean, spliced (the reconstruction in place of the activation) and zeroed, and the share
    recovered (1: as good as the model; 0: as bad as zeroing), for next tokens and, given datasets
    with answers, for the answers."""
    stash: dict[str, Tensor] = {}

    def keep(x: Tensor) -> Tensor:
        stash["x"] = x
        return x

    spliced = ([Intervention(d.hook_in, keep)] if d.is_transcoder else []) + [Intervention(d.hook_out, _past_bos(
        lambda x: d.decode(d.encode(stash.pop("x") if d.is_transcoder else x))))]
    zeroed = [Intervention(d.hook_out, _past_bos(torch.zeros_like))]
    measures: dict[str, Callable[[Sequence[Intervention]], float]] = {
        "next_token": lambda ivs: next_token_loss(model, prompts, ivs)}
    if answered:
        measures["answer"] = lambda ivs: answer_loss(model, answered, ivs)
    out: dict[str, float] = {}
    for name, loss in measures.items():
        clean, spliced_loss, zero = loss(()), loss(spliced), loss(zeroed)
        out.update({f"{name}_loss_clean": clean, f"{name}_loss_spliced": spliced_loss, f"{name}_loss_zeroed": zero,
                    f"{name}_loss_recovered": (zero - spliced_loss) / (zero - clean) if zero != clean else float("nan")})
    return out
