"""Attention-head scores: previous-token, duplicate-token and induction, over a dataset.

Detection patterns follow TransformerLens's head detector (transformer_lens.head_detector):
  previous_token   query q attends to q-1
  duplicate_token  q attends to every earlier k with token[k] == token[q]
  induction        q attends to every k with token[k-1] == token[q], k <= q (the token after an
                   earlier occurrence of the current token)
With `period` P (repeated random sequences), the targets are fixed by position instead of by
token identity: duplicate q -> q-P, induction q -> q-P+1 (chance repeats inside a sequence do
not count).

Two scores per head, averaged over prompts:
  score     mean, over the query positions that HAVE a target, of the attention mass on the targets.
            An ideal head scores 1.
  score_tl  TransformerLens's "mul" score: total attention mass on targets / total attention mass
            (= number of query positions). On a sequence repeated twice an ideal induction head
            scores about 0.5 by this measure, since the first half has no targets.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import make_batches, pad_id, tokenize_data
from ..errors import ConfigError, DataError, warn
from ..executors.shards import PerPrompt
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..operation import (
    Operation,
    Plan,
    Prepared,
    model_bytes,
    progress,
    register_operation,
)
from ..results.result import Result

HeadKind = Literal["previous_token", "duplicate_token", "induction"]


def detection_patterns(kind: str, tokens: Tensor, lengths: Tensor, period: int | None = None) -> Tensor:
    """[B, T, T] 0/1 targets (query, key) for a right-padded batch; zero outside each prompt."""
    B, T = tokens.shape
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    valid = (torch.arange(T)[None, :, None] < lengths[:, None, None]) & \
        (torch.arange(T)[None, None, :] < lengths[:, None, None])
    if kind == "previous_token":
        det = (k == q - 1).expand(B, T, T)
    elif period is not None and kind == "duplicate_token":
        det = ((k == q - period) & (q >= period)).expand(B, T, T)
    elif period is not None and kind == "induction":
        det = ((k == q - period + 1) & (q >= period)).expand(B, T, T)
    elif kind == "duplicate_token":
        det = (tokens[:, :, None] == tokens[:, None, :]) & (k < q)
    elif kind == "induction":
        prev = torch.cat([torch.full((B, 1), -1, dtype=tokens.dtype), tokens[:, :-1]], dim=1)  # token[k-1]
        det = (tokens[:, :, None] == prev[:, None, :]) & (k <= q) & (k >= 1)
    else:
        raise ValueError(kind)
    return (det & valid).to(torch.float32)


def score_patterns(pattern: Tensor, det: Tensor, lengths: Tensor, exclude_bos: bool = False,
                   exclude_current: bool = False) -> tuple[Tensor, Tensor]:
    """pattern [B, H, T, T], det [B, T, T] -> (score [B, H], score_tl [B, H])."""
    p = pattern
    if exclude_bos or exclude_current:
        p = p.clone()
        if exclude_bos:
            p[..., 0] = 0
        if exclude_current:
            p = p * (1 - torch.eye(p.shape[-1], device=p.device))
    T = p.shape[-1]
    row_valid = (torch.arange(T)[None, :] < lengths[:, None]).to(p.dtype)  # [B, T]
    on_target = (p * det[:, None]).sum(-1)  # [B, H, T]
    has_target = (det.sum(-1) > 0).to(p.dtype)  # [B, T]
    # a prompt with no target position has no score (NaN), rather than a silent 0
    score = (on_target * has_target[:, None]).sum(-1) / has_target.sum(-1)[:, None]
    total = (p.sum(-1) * row_valid[:, None]).sum(-1)
    score_tl = (on_target * row_valid[:, None]).sum(-1) / total
    return score, score_tl


@register_operation
class HeadScores(Operation):
    """Previous-token, duplicate-token and induction scores of every head (a layer x head table).

    kinds:           which scores.
    period:          the repeat period of repeated random sequences (targets by position), or None.
    exclude_bos:     ignore attention to position 0.
    exclude_current: ignore attention to the query's own position.
    """

    name = "head_scores"
    kinds: list[HeadKind] = Field(default_factory=lambda: ["previous_token", "duplicate_token", "induction"])
    period: int | None = Field(default=None, ge=1)
    exclude_bos: bool = False
    exclude_current: bool = False

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared:
        assert data is not None
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos)
        if self.period is not None and {"duplicate_token", "induction"} & set(self.kinds):
            short = [n for n in td.lengths if n <= self.period]
            if short:
                raise ConfigError(f"period {self.period} needs prompts longer than {self.period} tokens (a position "
                                  f"q >= period to score); {len(short)} of {len(td)} prompts have at most "
                                  f"{self.period} (shortest: {min(td.lengths)})", code="period_too_long",
                                  remedy="use the period the prompts repeat with (repeated_tokens: its length), or "
                                  "longer prompts")
        s = model.structure
        T = max(td.lengths)
        per_example = 4 * s.n_layers * s.n_heads * T * T * 2 + 4 * T * s.d_vocab
        bs = self.choose_batch_size(per_example, len(td))
        batches = make_batches(td, bs, pad_id(model))
        plan = Plan(self.name, rows=s.n_layers * s.n_heads * len(self.kinds), forward_passes=len(td),
                    backward_passes=0, batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=model_bytes(model) + bs * per_example)
        return Prepared(model, data, plan, {"batches": batches, "n": len(td)})

    # sharded (docs/scale.md): a shard returns its sums of the scores and its count of scored prompts
    sharded = True

    def shard_batches(self, prepared: Prepared) -> list[list[int]]:
        return [list(b.index) for b in prepared.state["batches"]]

    def execute_shard(self, prepared: Prepared, phase: str, batches: list[int], *, quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        s = model.structure
        mine = [st["batches"][i] for i in batches]
        reads = [ActName("pattern", L) for L in range(s.n_layers)]
        sums = {k: torch.zeros(2, s.n_layers, s.n_heads, dtype=torch.float64) for k in self.kinds}
        scored = {k: 0 for k in self.kinds}  # prompts with at least one target position
        for b in progress(mine, total=len(mine), desc="head scores", quiet=quiet):
            out = model.run(b.tokens, reads)
            for kind in self.kinds:
                det = detection_patterns(kind, b.tokens, b.lengths, self.period)
                scored[kind] += int((det.sum((1, 2)) > 0).sum())
                for L in range(s.n_layers):
                    sc, tl = score_patterns(out[reads[L]].float(), det, b.lengths, self.exclude_bos,
                                            self.exclude_current)
                    sums[kind][0, L] += sc.nan_to_num(0.0).sum(0).double()
                    sums[kind][1, L] += tl.sum(0).double()
        totals = {f"sums.{k}": v.numpy() for k, v in sums.items()} | {f"scored.{k}": np.asarray(v)
                                                                       for k, v in scored.items()}
        return PerPrompt([i for b in mine for i in b.index], {}, sums=totals)

    def summarise(self, prepared: Prepared, merged: dict[str, Any], *, quiet: bool = False) -> Result:
        st, s = prepared.state, prepared.model.structure
        sums = {k: torch.from_numpy(merged["main"][f"sums.{k}"]) for k in self.kinds}
        scored = {k: int(merged["main"][f"scored.{k}"]) for k in self.kinds}
        rows = []
        for kind in self.kinds:
            if scored[kind] == 0:
                raise DataError(f"no prompt has a {kind} target (a position whose token repeats an earlier one)",
                                code="no_targets", remedy="use prompts with repeats (task: repeated_tokens or "
                                "induction), or drop this kind")
            if scored[kind] < st["n"]:
                warn(f"{kind}: {st['n'] - scored[kind]} of {st['n']} prompts have no target position and are left out "
                     f"of `score` (score_tl counts them as 0, as TransformerLens does)", code="prompts_without_targets")
            score, score_tl = sums[kind][0] / scored[kind], sums[kind][1] / st["n"]
            for L in range(s.n_layers):
                for h in range(s.n_heads):
                    rows.append({"kind": kind, "layer": L, "head": h, "site": f"{L}.{h}",
                                 "score": float(score[L, h]), "score_tl": float(score_tl[L, h]),
                                 "n_prompts": scored[kind]})
        return Result(self.name, pd.DataFrame(rows), figures=_figures, title="attention head scores")


def _figures(result: Result) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    figs = []
    for kind, sub in result.table.groupby("kind", sort=False):
        grid = sub.pivot(index="layer", columns="head", values="score")
        fig = go.Figure(go.Heatmap(z=grid.values, x=[f"h{h}" for h in grid.columns], y=list(grid.index),
                                   zmin=0, zmax=1, colorscale="Viridis", texttemplate="%{z:.2f}"))
        fig.update_layout(xaxis_title="head", yaxis_title="layer", height=120 + 40 * len(grid))
        figs.append((f"{kind} score", fig))
    return figs
