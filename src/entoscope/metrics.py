"""Task metrics read from the logits at each prompt's answer position, one value per prompt.

A metric is a function `fn(logits [B, V], answers [B, A], wrong [B, W], reference [B, V] | None) -> [B]`
where `answers`/`wrong` hold token ids padded with -1, and `reference` is the unpatched run's logits
(for KL). Every row of the batch is scored (never only row 0). Registered by name:

    logit_diff  mean logit of the answers minus mean logit of the wrong answers
    logit       mean logit of the answers
    prob        total probability of the answers
    logprob     log of the total probability of the answers
    prob_diff   total probability of the answers minus that of the wrong answers (greater-than)
    kl          KL(reference || this run) at the answer position, in nats
    top1        1.0 when the top token is one of the answers, else 0.0
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import Tensor

from .config_model import ConfigModel
from .errors import CheckFailedError, ConfigError, DataError, EntoscopeError, MetricError
from .registry import lookup, register

MetricFn = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def _gather_mean(values: Tensor, ids: Tensor) -> Tensor:
    """Mean of values[b, ids[b, j]] over the valid (>= 0) ids of each row."""
    mask = ids >= 0
    picked = values.gather(-1, ids.clamp(min=0)) * mask
    return picked.sum(-1) / mask.sum(-1).clamp(min=1)


def _gather_sum(values: Tensor, ids: Tensor) -> Tensor:
    mask = ids >= 0
    return (values.gather(-1, ids.clamp(min=0)) * mask).sum(-1)


def _need(ids: Tensor | None, what: str) -> Tensor:
    if ids is None or bool((ids < 0).all(-1).any()):
        raise DataError(f"this metric needs {what} for every example", code="metric_needs_answers",
                        remedy=f"use data with {what} (e.g. a built-in task), or another metric")
    return ids


@register("metric", "logit_diff")
def logit_diff(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    return _gather_mean(logits, _need(answers, "answers")) - _gather_mean(logits, _need(wrong, "wrong answers"))


@register("metric", "logit")
def logit(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    return _gather_mean(logits, _need(answers, "answers"))


@register("metric", "prob")
def prob(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    return _gather_sum(logits.softmax(-1), _need(answers, "answers"))


@register("metric", "logprob")
def logprob(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    logp = logits.log_softmax(-1)
    ids = _need(answers, "answers")
    picked = logp.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf"))
    return picked.logsumexp(-1)


@register("metric", "prob_diff")
def prob_diff(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    p = logits.softmax(-1)
    return _gather_sum(p, _need(answers, "answers")) - _gather_sum(p, _need(wrong, "wrong answers"))


@register("metric", "kl")
def kl(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    if reference is None:
        raise DataError("kl needs the reference (unpatched) run's logits", code="metric_needs_reference",
                        remedy="use kl inside an operation that has a reference run (patching), or another metric")
    ref = reference.log_softmax(-1)
    return (ref.exp() * (ref - logits.log_softmax(-1))).sum(-1)


@register("metric", "top1")
def top1(logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
    top = logits.argmax(-1, keepdim=True)
    return (top == _need(answers, "answers")).any(-1).to(logits.dtype)


NEEDS_WRONG = {"logit_diff", "prob_diff"}
ANSWER_LOGITS_ONLY = {"logit_diff", "logit"}  # read no logit but the answers' and wrong answers'


class Metric(ConfigModel):
    """A metric by registered name, e.g. Metric(type="logit_diff"); a plain string works in configs."""


    type: str = Field(default="logit_diff", description="a registered metric: logit_diff, logit, prob, logprob, "
                      "prob_diff, kl, top1, or your own")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments bound to the metric's "
                                   "function")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    def function(self) -> MetricFn:
        """The registered function with `params` bound, checked on every call (see `CheckedMetric`)."""
        return CheckedMetric(self.type, lookup("metric", self.type), self.params)

    def __call__(self, logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
        return self.function()(logits, answers, wrong, reference)


_WHERE: ContextVar[str] = ContextVar("entoscope_metric_where", default="")


@contextlib.contextmanager
def metric_where(text: str) -> Iterator[None]:
    """Say where the metrics called inside the block are evaluated (named in their errors); nests."""
    outer = _WHERE.get()
    token = _WHERE.set(f"{outer}; {text}" if outer else text)
    try:
        yield
    finally:
        _WHERE.reset(token)


def check_metric_runs(metric: Callable[..., Tensor], model: Any, td: Any) -> None:
    """Call the metric once on stand-in logits (all zero, the model's vocabulary; the first prompt's answer
    ids) so that a metric the data cannot serve is refused before the run, as patching and steering do."""
    V = model.structure.d_vocab
    answers = torch.tensor([td.answers[0] or [-1]]) if td.answers else torch.tensor([[-1]])
    wrong = torch.tensor([td.wrong_answers[0] or [-1]]) if td.wrong_answers else torch.tensor([[-1]])
    logits = torch.zeros(1, V)
    with metric_where("checked on stand-in logits (all zero) before the run"):
        out = metric(logits, answers, wrong, logits)
    if not isinstance(out, torch.Tensor) or out.shape != (1,):
        raise ConfigError(f"the metric returned {getattr(out, 'shape', type(out))} for one prompt",
                          code="metric_shape", remedy="a metric returns one value per row: shape [B]")


class CheckedMetric:
    """A metric function with its parameters bound, checked where it is defined and on every call.

    Parameters the function does not take are refused when it is built. A call that raises is
    re-raised as MetricError naming the metric and where it ran (batch, site); a result that is not
    one finite value per row is refused (a NaN metric would silently poison every aggregate).
    """

    def __init__(self, name: str, fn: Callable[..., Tensor], params: dict[str, Any]) -> None:
        self.name, self.fn, self.params = name, fn, dict(params)
        if params:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):  # a builtin without a signature: nothing to check
                sig = None
            if sig is not None and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
                takes = [n for i, (n, p) in enumerate(sig.parameters.items()) if i >= 4 and
                         p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
                unknown = sorted(set(params) - set(takes))
                if unknown:
                    raise ConfigError(f"metric {name!r} takes no parameter {', '.join(map(repr, unknown))}",
                                      code="metric_param_unknown",
                                      remedy=f"{name} takes {', '.join(takes) if takes else 'no parameters'}")

    def __call__(self, logits: Tensor, answers: Tensor, wrong: Tensor, reference: Tensor | None = None) -> Tensor:
        where = _WHERE.get()
        at = f" ({where})" if where else ""
        try:
            out = self.fn(logits, answers, wrong, reference, **self.params)
        except EntoscopeError:
            raise
        except Exception as err:  # a user's metric: say which one failed and where, keep the cause
            raise MetricError(f"metric {self.name!r} raised {type(err).__name__}: {err}{at}", code="metric_failed",
                              remedy="fix the metric (it gets logits [B, vocab], answers [B, A], wrong answers "
                              "[B, W] padded with -1, reference logits or None) and return a tensor [B]") from err
        if not isinstance(out, Tensor) or out.shape != (logits.shape[0],):
            raise MetricError(f"metric {self.name!r} returned {getattr(out, 'shape', type(out).__name__)} for "
                              f"{logits.shape[0]} rows{at}", code="metric_shape",
                              remedy="a metric returns one value per row: a tensor of shape [B]")
        finite = torch.isfinite(out.detach())
        if not bool(finite.all()):
            rows = (~finite).nonzero().flatten()[:5].tolist()
            raise CheckFailedError(f"metric {self.name!r} is not finite (NaN or inf) in row(s) {rows}{at}",
                                   code="metric_non_finite",
                                   remedy="check the metric for a log of 0 or a division by 0, and the run's "
                                   "logits (answers that can have probability 0 in float precision?)")
        return out


def at_positions(logits: Tensor, positions: Tensor) -> Tensor:
    """logits[b, positions[b]] for every row: [B, V]."""
    return logits[torch.arange(logits.shape[0], device=logits.device), positions.to(logits.device)]


def readable(x: Tensor) -> Tensor:
    """`x` in a dtype numpy holds, at the model's own precision where it can: float16 and bfloat16 widened to
    float32 (exactly: every half-precision number is a float32), float32 and float64 kept as they are (a
    float64 model's metrics are not rounded to float32), anything else unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
