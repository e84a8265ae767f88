"""One batch of prompts, unsteered and under every condition: the metric, KL and loss of each (prompt, condition).

Conditions, in this order (C = 1 + 2K for K coefficients): 0 the unsteered run; 1..K the direction at
each coefficient; K+1..2K the random direction of the same norm at each coefficient. The unsteered run
is one read-only forward per batch (through run_with_cache, so a CachedModel serves it); the steered
rows (prompt x condition) run `rows` at a time in forwards with one intervention per written site,
each row with its own coefficient and vector. A condition that changes nothing (c = 0 under add and
project_out) is the unsteered run: its values are copied, not recomputed.

Per row (all in float64):
    metric   the task metric at the prompt's last token (each built-in task's score on its rows; NaN on text)
    kl       KL(steered || unsteered) of the next-token distribution, sum_v p_s (log p_s - log p_u), in
             nats, averaged over the prompt's positions (0 for the unsteered run)
    loss     the next-token cross-entropy of the prompt's own tokens, averaged over positions 0..len-2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import CheckFailedError
from ..metrics import MetricFn, at_positions, metric_where
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName
from .interventions import PositionRule, is_identity, make_edit

LOGIT_VALUES = 1 << 23  # vocabulary-sized values (rows x positions x vocabulary) the loss and KL make at once


@dataclass
class SteerSetup:
    """What every steered batch shares (built by Steering.prepare; `vectors` set from the driver's context)."""

    model: ModelAdapter
    sites: list[ActName]
    head: int | None
    mode: str
    coefficients: list[float]
    rule: PositionRule
    rows: int  # steered rows per forward
    normalize: bool = False
    vectors: Tensor | None = None  # [2, width]: the direction, the random baseline

    @property
    def n_conditions(self) -> int:
        return 1 + 2 * len(self.coefficients)

    def condition(self, j: int) -> tuple[int, float]:
        """(which vector: 0 direction / 1 random, coefficient) of condition j >= 1."""
        K = len(self.coefficients)
        return (0, self.coefficients[j - 1]) if j <= K else (1, self.coefficients[j - 1 - K])

    def steered_conditions(self) -> list[int]:
        """The conditions that change the run (the others are the unsteered run)."""
        if not self.rule.steers_prompt:
            return []
        return [j for j in range(1, self.n_conditions) if not is_identity(self.mode, self.condition(j)[1])]

    def interventions(self, conditions: Tensor, mask: Tensor) -> list[Intervention]:
        """One intervention per written site for rows with these conditions (0: unsteered) and position masks."""
        assert self.vectors is not None
        which = torch.tensor([self.condition(int(j))[0] if j > 0 else 0 for j in conditions])
        coef = torch.tensor([self.condition(int(j))[1] if j > 0 else 0.0 for j in conditions], dtype=torch.float64)
        mask = mask * (conditions > 0).to(mask.dtype)[:, None]  # the unsteered rows: nothing written
        vectors = self.vectors[which]
        if self.normalize:
            vectors = vectors / vectors.double().norm(dim=-1, keepdim=True).to(vectors.dtype)
        return [Intervention(site, make_edit(self.mode, coef, vectors, mask, self.head)) for site in self.sites]

    def name_of(self, j: int) -> str:
        which, c = self.condition(j)
        return f"coefficient {c:g} ({'the direction' if which == 0 else 'the random baseline'})"


@dataclass
class BatchRows:
    """One batch of prompts of one row set, ready to run."""

    set_name: str
    tokens: Tensor  # [B, T]
    lengths: Tensor  # [B]
    roles: Tensor | None
    answers: Tensor | None
    wrong: Tensor | None
    metric: MetricFn | None
    where: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def steer_batch(setup: SteerSetup, batch: BatchRows, tick: Callable[[], None] = lambda: None) -> dict[str, np.ndarray]:
    """[B, C] metric, kl and loss of every prompt of the batch under every condition (see the module docstring)."""
    model = setup.model
    B, C = len(batch.lengths), setup.n_conditions
    out = {k: np.full((B, C), np.nan) for k in ("metric", "kl", "loss")}
    with torch.no_grad():
        clean = model.run(batch.tokens).logits
        last = batch.lengths - 1
        reference = at_positions(clean, last)
        metric_u = _score(batch, reference, reference, "the unsteered run")
        logp_u = _log_softmax(clean)
        del clean  # only the log-probabilities are kept for the KL
        loss_u = _loss(logp_u, batch.tokens, batch.lengths)
        for j in range(C):  # every condition starts as the unsteered run; steered ones are replaced below
            out["metric"][:, j], out["loss"][:, j], out["kl"][:, j] = metric_u, loss_u, 0.0
        todo = setup.steered_conditions()
        pairs = [(i, j) for j in todo for i in range(B)]
        mask = setup.rule.mask(batch.set_name, batch.lengths, batch.roles, batch.tokens.shape[1]) \
            if todo else None
        for lo in range(0, len(pairs), setup.rows):
            rows = pairs[lo:lo + setup.rows]
            ex = torch.tensor([i for i, _ in rows])
            cond = torch.tensor([j for _, j in rows])
            assert mask is not None
            logits = _run_rows(setup, batch.tokens[ex], mask[ex], cond)
            at = at_positions(logits, last[ex])
            out["metric"][ex.numpy(), cond.numpy()] = _score(batch, at, reference[ex], "steered rows", ex)
            loss, kl = _loss_and_kl(logits, logp_u, ex, batch.tokens[ex], batch.lengths[ex])
            del logits
            out["loss"][ex.numpy(), cond.numpy()], out["kl"][ex.numpy(), cond.numpy()] = loss, kl
            tick()
    return out


def _run_rows(setup: SteerSetup, tokens: Tensor, mask: Tensor, cond: Tensor) -> Tensor:
    """The steered forward of some rows; a run that overflows is refused naming the condition that made it."""
    try:
        return setup.model.run(tokens, interventions=setup.interventions(cond, mask)).logits
    except CheckFailedError as err:
        if err.code != "non_finite":
            raise
        bad = []
        for j in sorted(set(cond.tolist()), key=lambda j: abs(setup.condition(j)[1])):
            rows = cond == j
            try:
                setup.model.run(tokens[rows][:1], interventions=setup.interventions(cond[rows][:1], mask[rows][:1]))
            except CheckFailedError:
                bad.append(setup.name_of(j))
        raise CheckFailedError(f"steering at {bad[0] if bad else 'these coefficients'} makes the run's activations NaN "
                               f"or inf ({err.message})", code="steering_non_finite",
                               remedy="choose other coefficients (smaller ones under add; under set, a target the "
                               "site can hold: a norm's scale of 0 divides by 0); a float16 model overflows sooner "
                               "than float32") from None


def _loss_and_kl(logits: Tensor, logp_u: Tensor, ex: Tensor, tokens: Tensor, lengths: Tensor
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each steered row's loss and KL to its prompt's unsteered run (row i: prompt ex[i]), a few rows at a time:
    the log-softmax and the KL's terms are vocabulary-sized per position, made only for LOGIT_VALUES at once."""
    step = max(1, LOGIT_VALUES // max(1, logits.shape[1] * logits.shape[2]))
    loss, kl = [], []
    for lo in range(0, len(logits), step):
        rows = slice(lo, lo + step)
        logp = _log_softmax(logits[rows])
        loss.append(_loss(logp, tokens[rows], lengths[rows]))
        kl.append(_kl(logp, logp_u[ex[rows].to(logp_u.device)], lengths[rows]))
    return np.concatenate(loss), np.concatenate(kl)


def _log_softmax(logits: Tensor) -> Tensor:
    return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).log_softmax(-1)


def _score(batch: BatchRows, logits: Tensor, reference: Tensor, what: str, ex: Tensor | None = None) -> np.ndarray:
    if batch.metric is None:
        return np.full(len(logits), np.nan)
    assert batch.answers is not None and batch.wrong is not None
    answers = batch.answers if ex is None else batch.answers[ex]
    wrong = batch.wrong if ex is None else batch.wrong[ex]
    dev = logits.device
    with metric_where(f"{batch.where}; {what}"):
        return batch.metric(logits, answers.to(dev), wrong.to(dev), reference).double().cpu().numpy()


def _loss(logp: Tensor, tokens: Tensor, lengths: Tensor) -> np.ndarray:
    """Mean over positions 0..len-2 of -log p(next token); NaN for a one-token prompt."""
    dev = logp.device
    nll = -logp[:, :-1].gather(-1, tokens[:, 1:].to(dev)[..., None])[..., 0].double()
    valid = (torch.arange(nll.shape[1], device=dev)[None, :] < (lengths.to(dev) - 1)[:, None]).double()
    with np.errstate(invalid="ignore"):
        return ((nll * valid).sum(1) / valid.sum(1)).cpu().numpy()


def _kl(logp_s: Tensor, logp_u: Tensor, lengths: Tensor) -> np.ndarray:
    """Mean over the prompt's positions of KL(steered || unsteered), in nats."""
    dev = logp_s.device
    per_position = (logp_s.exp() * (logp_s - logp_u.to(dev))).sum(-1).double()
    valid = (torch.arange(per_position.shape[1], device=dev)[None, :] < lengths.to(dev)[:, None]).double()
    return ((per_position * valid).sum(1) / valid.sum(1)).cpu().numpy()
