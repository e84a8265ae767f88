"""Poolings: how one prompt's activations at a site become one feature vector for a probe.

Over positions (registry kind "pooling"): `fn(x [B, T, ...], lengths [B], at [B] | None) -> [B, ...]`,
on a right-padded batch (positions >= lengths[b] are padding and must not be read):
  mean    mean over each prompt's real tokens, a leading BOS left out (the rule of steering's read_at mean):
          position 0 holding the model's BOS token is the same in every prompt (it sees only itself) and
          often of outsized norm (an attention sink), so counted in it pulls every prompt's mean toward one
          vector by 1/length, a length effect. `bos_in_mean: true` counts it. `at` is then each prompt's
          first position counted (1 after a leading BOS, else 0; None: 0)
  max     elementwise maximum over each prompt's real tokens
  first   position 0 (with a prepended BOS this is the BOS token, the same for every prompt)
  last    each prompt's last token
  marked  the token at a per-prompt position found from a `meta` key: a token string looked up in the
          prompt (the `occurrence`-th match; " John" and "John" both match the token " John") or an
          index (negative from the prompt's end)
  index   the token at a per-prompt index read from a `meta` key (integers only)
A pooling that reads one position per prompt also says which (`positions`), so the causal check
ablates exactly what the probe read; the others (mean, max, yours) are ablated at every position.

Over heads (registry kind "head_pooling"), for per-head kinds (z, q, k, v, result) read without a
head axis: `fn(x [B, H, d]) -> [B, F]`:
  concat  all heads side by side (F = H * d)
  mean    mean over heads (F = d)
  sum     sum over heads (F = d; for `result` this is attn_out without its bias)

Register your own with `@entoscope.register("pooling", "name")` (the function above; it gets `at`
when the config names a `key`) or `@entoscope.register("head_pooling", "name")`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..config_model import ConfigModel
from ..errors import ConfigError, DataError
from ..registry import lookup, register

PoolFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]
PositionsFn = Callable[[Tensor, Tensor | None], Tensor]
POSITION_KEYED = ("marked", "index")  # built-ins that need a per-prompt position from `meta`


def _real(x: Tensor, lengths: Tensor) -> Tensor:
    """[B, T, 1, ...] mask of real (non-pad) positions, broadcastable to x."""
    T = x.shape[1]
    mask = torch.arange(T, device=x.device)[None, :] < lengths.to(x.device)[:, None]
    return mask.reshape(*mask.shape, *([1] * (x.ndim - 2)))


def _gather(x: Tensor, positions: Tensor) -> Tensor:
    return x[torch.arange(x.shape[0], device=x.device), positions.to(x.device)]


def reads_one_position(positions: PositionsFn) -> Callable[[PoolFn], PoolFn]:
    """Mark a pooling as reading the single position `positions(lengths, at)` of each prompt."""
    def mark(fn: PoolFn) -> PoolFn:
        fn.positions = positions  # type: ignore[attr-defined]
        return fn
    return mark


@register("pooling", "mean")
def mean_pool(x: Tensor, lengths: Tensor, at: Tensor | None = None) -> Tensor:
    """The mean over positions at..lengths - 1 of each prompt (at None: from 0)."""
    mask = _real(x, lengths)
    count = lengths.to(x.device, x.dtype)
    if at is not None:
        first = at.to(x.device)
        t = torch.arange(x.shape[1], device=x.device)[None, :] >= first[:, None]
        mask = mask & t.reshape(*t.shape, *([1] * (x.ndim - 2)))
        count = count - first.to(x.dtype)
    return (x * mask).sum(1) / count.reshape(-1, *([1] * (x.ndim - 2)))


@register("pooling", "max")
def max_pool(x: Tensor, lengths: Tensor, at: Tensor | None = None) -> Tensor:
    return x.masked_fill(~_real(x, lengths), float("-inf")).amax(1)


@register("pooling", "first")
@reads_one_position(lambda lengths, at: torch.zeros_like(lengths))
def first_pool(x: Tensor, lengths: Tensor, at: Tensor | None = None) -> Tensor:
    return x[:, 0]


@register("pooling", "last")
@reads_one_position(lambda lengths, at: lengths - 1)
def last_pool(x: Tensor, lengths: Tensor, at: Tensor | None = None) -> Tensor:
    return _gather(x, lengths - 1)


def _at(lengths: Tensor, at: Tensor | None) -> Tensor:
    assert at is not None, "a keyed pooling got no positions"
    return at


@reads_one_position(_at)
def at_pool(x: Tensor, lengths: Tensor, at: Tensor | None = None) -> Tensor:
    return _gather(x, _at(lengths, at))


register("pooling", "marked")(at_pool)
register("pooling", "index")(at_pool)


@register("head_pooling", "concat")
def concat_heads(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1)


@register("head_pooling", "mean")
def mean_heads(x: Tensor) -> Tensor:
    return x.mean(1)


@register("head_pooling", "sum")
def sum_heads(x: Tensor) -> Tensor:
    return x.sum(1)


def head_pooled_size(name: str, n_heads: int, d: int) -> int:
    """Feature size of a built-in head pooling; a user's pooling is measured on a stand-in."""
    if name == "concat":
        return n_heads * d
    if name in ("mean", "sum"):
        return d
    return int(lookup("head_pooling", name)(torch.zeros(1, n_heads, d)).reshape(1, -1).shape[1])


class Pooling(ConfigModel):
    """How positions are pooled: a registered name, or {type, key, occurrence}; a plain string works.

    type:       mean, max, first, last, marked, index, or a pooling you registered.
    key:        the `meta` key holding each prompt's position (marked: a token string or an index;
                index: an index); negative indices count from the prompt's end.
    occurrence: marked with a token string: which match (0 = first, -1 = last, ...).
    bos_in_mean: mean: count a leading BOS in the mean (default: left out, as steering's read_at mean).
    """

    type: str = Field(default="last", description="mean, max, first, last, marked, index, or a registered pooling")
    key: str | None = Field(default=None, description="marked / index: the meta key holding each prompt's position "
                            "(negative: from its end)")
    occurrence: int = Field(default=0, description="marked with a token string: which match (0 = first, -1 = last)")
    bos_in_mean: bool = Field(default=False, description="mean: count a leading BOS (position 0 holding the BOS "
                              "token) in the mean (default: left out, as steering's read_at mean)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _bos_for_mean(self) -> Pooling:
        if self.bos_in_mean and self.type != "mean":
            raise ValueError(f"bos_in_mean is an option of pooling mean, not of {self.type!r}")
        return self

    def leaves_bos_out(self) -> bool:
        """Whether this pooling leaves a leading BOS out (mean, unless bos_in_mean)."""
        return self.type == "mean" and not self.bos_in_mean

    def function(self) -> PoolFn:
        fn = lookup("pooling", self.type)
        if self.type in POSITION_KEYED and self.key is None:
            raise ConfigError(f"pooling {self.type!r} needs `key`: the meta field that says where to read",
                              code="pooling_needs_key",
                              remedy="e.g. pooling: {type: marked, key: s, occurrence: -1} (IOI: the second "
                              "mention of the subject)")
        return fn

    def positions(self, prompts: Sequence[Sequence[int]], metas: Sequence[Any], vocab: list[str],
                  bos_id: int | None = None) -> Tensor | None:
        """[N] absolute position of each prompt (from `key`), or None when no key is given. Pooling mean without
        bos_in_mean: each prompt's first position counted (1 where position 0 holds `bos_id`, else 0)."""
        if self.leaves_bos_out():
            if bos_id is None:
                return None
            starts = [int(len(ids) > 0 and int(ids[0]) == bos_id) for ids in prompts]
            alone = [i for i, (ids, s) in enumerate(zip(prompts, starts)) if s and len(ids) == 1]
            if alone:
                raise DataError(f"prompt {alone[0]} is its BOS token alone: pooling mean leaves the BOS out, so "
                                "nothing is left to average", code="pooling_mean_empty",
                                remedy="give every prompt some text, or pooling: {type: mean, bos_in_mean: true}")
            return torch.tensor(starts, dtype=torch.long)
        if self.key is None:
            return None
        out = []
        for i, (ids, meta) in enumerate(zip(prompts, metas)):
            if self.key not in meta:
                raise DataError(f"example {i} has no meta field {self.key!r} (pooling {self.type!r})",
                                code="data_field_missing",
                                remedy=f"give every example meta.{self.key}, or another pooling key")
            out.append(self._position(i, list(ids), meta[self.key], vocab))
        return torch.tensor(out, dtype=torch.long)

    def _position(self, i: int, ids: list[int], value: Any, vocab: list[str]) -> int:
        n = len(ids)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise DataError(f"example {i}: meta.{self.key} = {value!r} is neither a token index nor a token string",
                            code="pooling_position_missing", remedy="store an int index or the token's text")
        if isinstance(value, str):
            if self.type == "index":
                raise DataError(f"example {i}: pooling 'index' needs an integer in meta.{self.key}, got {value!r}",
                                code="pooling_position_missing",
                                remedy="use pooling type 'marked' to find a token string in the prompt")
            target = value.strip()
            matches = [p for p, t in enumerate(ids) if vocab[t] == value or vocab[t].strip() == target]
            if not -len(matches) <= self.occurrence < len(matches):
                pieces = [vocab[t] for t in ids]
                raise DataError(f"example {i}: the token {value!r} (occurrence {self.occurrence}) is not in the "
                                f"prompt, whose tokens are {pieces}", code="pooling_position_missing",
                                remedy="mark a word that is one token of the prompt, or a token index")
            return matches[self.occurrence]
        if not -n <= value < n:
            raise DataError(f"example {i}: position meta.{self.key} = {value} is outside its {n} tokens",
                            code="pooling_position_missing", remedy=f"use -{n}..{n - 1}")
        return value % n
