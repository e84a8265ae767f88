"""Attention-head scores: previous-token, duplicate-token and induction, over a dataset.

Detection patterns follow TransformerLens's head detector (transformer_lens.head_detector):
  previous_token   query q attends to q-1
  duplicate_token  q attends to every earlier k with token[k] == token[q]
  induction        q attends to every k with token[k-1] == token[q], k <= q (the token after an
                   earlier occurrence of the current token)
With `period` P (repeated random sequences), the targets are fixed by position instead of by
token identity: duplicate q -> q-P, induction q -> q-P+1 (chance repeats inside a sequence do
not count), for the queries q >= o + P of the second copy, where o is where the first copy starts:
the example's meta `offset` (tokens before the first copy in the prompt as given, as
repeated_tokens records it; a BOS prepended to a text prompt adds one), else 1 when the prompt's
first token is the BOS, else 0. A BOS is never part of the repeated sequence.

Two scores per head, averaged over prompts:
  score     mean, over the query positions that HAVE a target, of the attention mass on the targets.
            An ideal head scores 1.
  score_tl  TransformerLens's "mul" score: total attention mass on targets / total attention mass
            (= number of query positions). On a sequence repeated twice an ideal induction head
            scores about 0.5 by this measure, since the first half has no targets.
Both are means over prompts of per-prompt scores (the per-prompt table; a prompt without a target
position has no `score`), and each carries its bootstrap interval over prompts (`score_ci_low`,
`score_ci_high`, `score_tl_ci_low`, ...; `summarise_head_scores`, from the per-prompt table alone).

The test (what `significant` and `confirm` read): a head's score against chance.
  chance    the `score` a head attending uniformly over the causal keys would get (1 / (q + 1) on each key
            k <= q, with the same exclusions), per prompt: the mean over the target queries of (targets
            left after the exclusions) / (q + 1). The same for every head of a kind; the table's `chance` is
            its mean over the prompts with a target position.
  excess    score - chance, per prompt, and its mean over those prompts (= score - chance in the table),
            with its interval, `excess_p` (two-sided, against 0: the interval's inversion, then the
            sign-flip test below 1 - ci_level, stats/signflip.py), `excess_q` (Benjamini-Hochberg over
            every kind x layer x head) and `significant`. A head below chance (attention kept off its
            targets, e.g. on the BOS) differs from chance too, with a negative excess.
Uniform causal attention is the null model of an attention pattern carrying no information about the
targets (the "random baseline" of Olsson et al. 2022's prefix-matching scores reads the same way); a head
that is significant has more (or less) attention on its targets than that. Nearly every head of a trained
model differs from uniform attention, so this test separates little; the takeaway does not lead with it.

The control (what the takeaway names heads by, `passes`): a head of a kind would fail it.
  control   with a period, the same head's `score` at the same targets on a control prompt: the prompt with
            its second copy's tokens shuffled (a derangement of the first copy: no token at its own place,
            seeded by the run's seed and the example's index), so no query of the second copy repeats the
            token its duplicate target holds or follows its induction target's predecessor. A duplicate-token
            or induction head attends to its targets because of the repeat, and loses them there; a head
            attending by position alone (a fixed offset) keeps them. Not for previous-token heads: one attends
            to the token before whatever the tokens are, so no shuffle of the tokens fails it.
  over_control  score - control per prompt, its mean over the prompts with a target and its interval.
  passes    duplicate-token and induction (with the control): the interval of `over_control` lies wholly
            above CONTROL_MARGIN (results/claims.py: at least that share of its attention moves onto its
            targets because the tokens repeat); previous-token (and any kind without a control): the `most`
            rule on `score` (at least half of its attention on its targets, the interval's lower end above
            one half). docs/circuits.md and docs/pages.md say the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from .. import naming
from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..errors import ConfigError, DataError, warn
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import readable
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED_LEAN, Footprint
from ..models.names import ActName
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.claims import clears, most
from ..results.lazy import LazyTable
from ..results.result import Result
from ..stats import Stats, interval_columns, streamed_mean, summarise
from ..stats.columns import hover_value, level_text
from ..stats.footprint import summary_bytes
from ..stats.moments import column_moments
from .head_figures import SCALE_TITLE
from .scores_takeaway import head_scores_takeaway

HeadKind = Literal["previous_token", "duplicate_token", "induction"]


def detection_patterns(kind: str, tokens: Tensor, lengths: Tensor, period: int | None = None,
                       offsets: Tensor | None = None) -> Tensor:
    """[B, T, T] 0/1 targets (query, key) for a right-padded batch; zero outside each prompt. With a
    period, offsets [B] is where each prompt's first copy starts (default 0)."""
    B, T = tokens.shape
    if period is not None:
        start = (torch.zeros(B, dtype=torch.long) if offsets is None else offsets.long())[:, None, None] + period
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    valid = (torch.arange(T)[None, :, None] < lengths[:, None, None]) & \
        (torch.arange(T)[None, None, :] < lengths[:, None, None])
    if kind == "previous_token":
        det = (k == q - 1).expand(B, T, T)
    elif period is not None and kind == "duplicate_token":
        det = (k == q - period) & (q >= start)
    elif period is not None and kind == "induction":
        det = (k == q - period + 1) & (q >= start)
    elif kind == "duplicate_token":
        det = (tokens[:, :, None] == tokens[:, None, :]) & (k < q)
    elif kind == "induction":
        prev = torch.cat([torch.full((B, 1), -1, dtype=tokens.dtype), tokens[:, :-1]], dim=1)  # token[k-1]
        det = (tokens[:, :, None] == prev[:, None, :]) & (k <= q) & (k >= 1)
    else:
        raise ValueError(kind)
    return (det & valid).to(torch.float32)


def period_offsets(model: ModelAdapter, data: Dataset, prompts: list[list[int]], prepend_bos: bool) -> list[int]:
    """Per prompt, the token index where the first copy of a repeated sequence starts: meta `offset`
    (counted in the prompt as given; a BOS prepended to a text prompt adds one), else 1 when the
    tokens start with the BOS, else 0."""
    bos, out = model.bos_token_id, []
    for e, ids in zip(data, prompts):
        if "offset" in e.meta:
            out.append(int(e.meta["offset"]) + int(prepend_bos and isinstance(e.prompt, str)))
        else:
            out.append(int(bool(ids) and bos is not None and ids[0] == bos))
    return out


def uniform_pattern(lengths: Tensor, T: int) -> Tensor:
    """[B, 1, T, T] the pattern of a head attending uniformly over the causal keys: 1 / (q + 1) on each key
    k <= q of a query inside its prompt (right-padded), 0 elsewhere (the chance level of a score)."""
    q = torch.arange(T)[:, None]
    causal = (torch.arange(T)[None, :] <= q).to(torch.float64) / (q + 1)
    inside = (torch.arange(T)[None, :, None] < lengths[:, None, None]).to(torch.float64)
    return (causal[None] * inside)[:, None]


CONTROLLED = ("duplicate_token", "induction")  # the kinds a shuffled second copy fails


def control_tokens(tokens: Tensor, lengths: Tensor, offsets: Sequence[int], period: int, seed: int,
                   examples: Sequence[int]) -> Tensor:
    """[B, T] the control prompts of a right-padded batch: each prompt's second copy (positions o + P .. o + 2P - 1
    that exist) replaced by the first copy's tokens in a deranged order (position o + P + i takes the token of
    o + pi(i), pi a permutation of 0..P-1 with no pi(i) = i, drawn from numpy's generator seeded by (seed,
    example index), so a prompt's control is the same in any batch or shard); everything else is kept. With
    P = 1 no derangement exists and the prompt is kept (its control scores are then its scores)."""
    out = tokens.clone()
    for j, (ex, o) in enumerate(zip(examples, offsets)):
        m = min(period, int(lengths[j]) - o - period)  # second-copy positions in this prompt
        if period < 2 or m < 1:
            continue
        rng = np.random.default_rng([seed, int(ex)])
        while True:
            pi = rng.permutation(period)
            if not (pi == np.arange(period)).any():
                break
        out[j, o + period:o + period + m] = tokens[j, torch.as_tensor(o + pi[:m])]
    return out


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


@dataclass(frozen=True)
class HeadScoresState:
    """What the head scores' prepare resolved: the batches."""

    batches: list[Batch]
    offsets: tuple[int, ...] = ()  # with a period: where each prompt's first copy starts (period_offsets)
    controls: tuple[Tensor, ...] = ()  # with the control: each batch's control prompts (control_tokens)


@register_operation
class HeadScores(Sharded, Operation):
    """Previous-token, duplicate-token and induction scores of every head (a layer x head table).

    kinds:           which scores.
    period:          the repeat period of repeated random sequences (targets by position), or None;
                     the first copy starts after a leading BOS, or at the example's meta `offset`.
    exclude_bos:     ignore attention to position 0.
    exclude_current: ignore attention to the query's own position.
    control:         with a period, score duplicate-token and induction heads again on control prompts (the
                     second copy shuffled) and name heads by score - control (the module's docstring).
    """

    name = "head_scores"
    tests_cells = True  # excess over chance: p, q and significant per row (the plan's screen, confirm)
    kinds: list[HeadKind] = Field(default_factory=lambda: ["previous_token", "duplicate_token", "induction"],
                                  description="which scores: previous_token, duplicate_token, induction")
    period: int | None = Field(default=None, ge=1, description="repeated random sequences: the repeat period, "
                               "targets then fixed by position; null: targets by matching tokens")
    exclude_bos: bool = Field(default=False, description="ignore attention to position 0")
    exclude_current: bool = Field(default=False, description="ignore attention to the query's own position")
    control: bool = Field(default=True, description="with a period: score duplicate-token and induction heads again "
                          "on control prompts whose second copy is shuffled (no token at its own place) and test "
                          "score - control (a head of the kind fails the control; docs/circuits.md)")

    def uses_control(self) -> bool:
        return self.control and self.period is not None and self.period >= 2 and bool(set(CONTROLLED) & set(self.kinds))

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[HeadScoresState]:
        assert data is not None
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos)
        offsets = period_offsets(model, data, td.prompts, self.prepend_bos) if self.period is not None else []
        if self.period is not None and {"duplicate_token", "induction"} & set(self.kinds):
            short = [n for n, o in zip(td.lengths, offsets) if n <= o + self.period]
            if short:
                raise ConfigError(f"period {self.period} needs prompts longer than their offset + {self.period} "
                                  f"tokens (a query of the second copy to score); {len(short)} of {len(td)} prompts "
                                  f"are not (shortest: {min(td.lengths)})", code="period_too_long",
                                  remedy="use the period the prompts repeat with (repeated_tokens: its length), or "
                                  "longer prompts")
        s = model.structure
        T = max(td.lengths)
        # a batch holds every layer's pattern, its forward (no logits but the last position's) and, a layer at a
        # time, the scoring's float32 temporaries; again for its control; then the summary's chunks
        fp = Footprint(model)
        reads = [ActName("pattern", L) for L in range(s.n_layers)]
        per_example = (fp.act(reads, 1, T) + fp.forward(1, T, logit_rows=0) + s.d_vocab * fp.f  # one logit row
                       + 2 * s.n_heads * T * T * 4) \
            * (2 if self.uses_control() else 1)
        LHK = s.n_layers * s.n_heads * len(self.kinds)  # score and score_tl (and control) untested, the excess tested
        untested = self.stats.model_copy(update={"refine_p": False})
        summary = max(summary_bytes(len(td), 2 * LHK, untested), summary_bytes(len(td), LHK, self.stats))
        bs = self.choose_batch_size(0, len(td), peak_of=lambda b: FIXED_LEAN + max(b * per_example, summary))
        batches = make_batches(td, bs, pad_id(model))
        controls: tuple[Tensor, ...] = ()
        if self.uses_control():
            assert self.period is not None
            controls = tuple(control_tokens(b.tokens, b.lengths, [offsets[i] for i in b.index], self.period,
                                            self.seed, b.index) for b in batches)
        notes = ([f"control: each prompt again with its second copy shuffled ({', '.join(CONTROLLED)} heads scored "
                  "there too)"] if controls else [])
        plan = Plan(self.name, rows=s.n_layers * s.n_heads * len(self.kinds), forward_passes=len(td) * (2 if controls
                                                                                                       else 1),
                    backward_passes=0, batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=FIXED_LEAN + max(bs * per_example, summary), notes=notes)
        return Prepared(model, data, plan, HeadScoresState(batches, tuple(offsets), controls))

    # sharded (docs/scale.md): a shard returns its prompts' scores; summarise has every prompt's
    def execute_shard(self, prepared: Prepared[HeadScoresState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        s = model.structure
        reads = [ActName("pattern", L) for L in range(s.n_layers)]
        mine = [st.batches[i] for i in batches]
        examples = [i for b in mine for i in b.index]
        n = len(examples)
        # per kind [4, n, L, H]: score, score_tl, chance, control (NaN: no control for this kind)
        per_prompt = {k: torch.full((4, n, s.n_layers, s.n_heads), float("nan"), dtype=torch.float64)
                      for k in self.kinds}
        start = 0
        for bi, b in progress(list(zip(batches, mine)), total=len(mine), desc="head scores", quiet=quiet):
            out = control = None  # the previous batch's patterns are released before this batch's forward
            out = model.run(b.tokens, reads, logits=False)  # the patterns only: no vocabulary-sized logits
            control = model.run(st.controls[bi], reads, logits=False) if st.controls else None
            idx = torch.arange(start, start + len(b))  # this shard's rows
            start += len(b)
            for kind in self.kinds:
                det = detection_patterns(kind, b.tokens, b.lengths, self.period,
                                         torch.tensor([st.offsets[i] for i in b.index]) if st.offsets else None)
                chance, _ = score_patterns(uniform_pattern(b.lengths, det.shape[-1]), det, b.lengths,
                                           self.exclude_bos, self.exclude_current)  # [B, 1]
                per_prompt[kind][2, idx] = chance.double().cpu()[:, :, None]
                for L in range(s.n_layers):
                    sc, tl = score_patterns(readable(out[reads[L]]), det, b.lengths, self.exclude_bos,
                                            self.exclude_current)
                    per_prompt[kind][0, idx, L] = sc.double().cpu()
                    per_prompt[kind][1, idx, L] = tl.double().cpu()
                    if control is not None and kind in CONTROLLED:  # the same targets on the control prompt
                        cs, _ = score_patterns(readable(control[reads[L]]), det, b.lengths, self.exclude_bos,
                                               self.exclude_current)
                        per_prompt[kind][3, idx, L] = cs.double().cpu()
        return PerPrompt(examples, {k: v.transpose(0, 1).numpy() for k, v in per_prompt.items()})  # [n, 4, L, H]

    def summarise(self, prepared: Prepared[HeadScoresState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        s, columns = prepared.model.structure, merged["main"]
        n = columns.n
        kinds = list(self.kinds)
        table = head_score_summary(n, kinds, s.n_layers, s.n_heads, lambda lo, hi: columns.read(lo, hi, kinds),
                                   self.stats, self.seed, [k for k in CONTROLLED if self.uses_control()])
        for kind in self.kinds:
            scored = int(table.loc[table["kind"] == kind, "n_prompts"].iloc[0])  # prompts with a target position
            if scored == 0:
                raise DataError(f"no prompt has a {kind} target (a position whose token repeats an earlier one)",
                                code="no_targets", remedy="use prompts with repeats (task: repeated_tokens or "
                                "induction), or drop this kind")
            if scored < n:
                warn(f"{kind}: {n - scored} of {n} prompts have no target position and are left out "
                     f"of `score` (score_tl counts them as 0, as TransformerLens does)", code="prompts_without_targets")
        per_prompt = LazyTable(len(kinds) * n,
                               lambda lo, hi: _frame_rows(columns, kinds, s.n_layers, s.n_heads, lo, hi),
                               rows_per_prompt=s.n_layers * s.n_heads)
        return Result(self.name, table, per_prompt=per_prompt, figures=_figures,
                      title="attention head scores: how much of its attention each head puts on its targets",
                      takeaway=head_scores_takeaway)


def _frame_rows(columns: Any, kinds: list[str], n_layers: int, n_heads: int, lo: int, hi: int) -> pd.DataFrame:
    """Rows lo..hi-1 of the per-prompt table, which runs kind by kind, then prompt by prompt."""
    n, frames = columns.n, []
    for k, kind in enumerate(kinds):
        a, b = max(lo, k * n) - k * n, min(hi, (k + 1) * n) - k * n
        if a < b:
            v = torch.from_numpy(columns.read(a, b, [kind])[kind]).transpose(0, 1)  # [4, rows, L, H]
            frames.append(head_score_frame({kind: v}, n_layers, n_heads, first=a))
    return pd.concat(frames, ignore_index=True) if frames else head_score_frame({}, n_layers, n_heads)


def head_score_frame(per_prompt: dict[str, Tensor], n_layers: int, n_heads: int, first: int = 0) -> pd.DataFrame:
    """The per-prompt table: one row per (kind, example, layer, head) with `score` (NaN: no target
    position in that prompt), `score_tl`, `chance` (the score of uniform causal attention on that
    prompt, the same for every head) and `control` (the head's score on the prompt's control, NaN where the
    kind has none). per_prompt[kind]: [4, n, layers, heads] of examples first.. (3 rows: no control)."""
    frames = [pd.DataFrame(columns=["kind", "example", "layer", "head", "site", "score", "score_tl", "chance",
                                    "control"])]
    for kind, v in per_prompt.items():
        n = v.shape[1]
        ex, L, h = np.meshgrid(np.arange(first, first + n), np.arange(n_layers), np.arange(n_heads), indexing="ij")
        frames.append(pd.DataFrame({"kind": kind, "example": ex.reshape(-1), "layer": L.reshape(-1),
                                    "head": h.reshape(-1),
                                    "site": [naming.head(a, b) for a, b in zip(L.reshape(-1), h.reshape(-1))],
                                    "score": v[0].reshape(-1).numpy(), "score_tl": v[1].reshape(-1).numpy(),
                                    "chance": v[2].reshape(-1).numpy(),
                                    "control": (v[3].reshape(-1).numpy() if len(v) > 3
                                                else np.full(v[0].numel(), np.nan))}))
    return pd.concat(frames[1:], ignore_index=True) if len(frames) > 1 else frames[0]


def summarise_head_scores(per_prompt: pd.DataFrame, stats: Stats, seed: int) -> pd.DataFrame:
    """One row per (kind, layer, head) from the per-prompt table: what `head_score_summary` computes from
    the arrays."""
    kinds = list(dict.fromkeys(per_prompt["kind"]))
    n_layers, n_heads = int(per_prompt["layer"].max()) + 1, int(per_prompt["head"].max()) + 1
    arrays = {}
    for kind, sub in per_prompt.groupby("kind", sort=False):
        sub = sub.sort_values(["example", "layer", "head"], kind="stable")  # every (example, layer, head) once
        shape = (sub["example"].nunique(), n_layers, n_heads)
        grids = [sub[col].to_numpy(dtype=np.float64).reshape(shape) if col in sub else np.full(shape, np.nan)
                 for col in ("score", "score_tl", "chance", "control")]
        arrays[kind] = np.stack(grids, 1)  # [n, 4, L, H]
    n = len(next(iter(arrays.values())))
    controlled = [k for k, v in arrays.items() if np.isfinite(v[:, 3]).any()]
    return head_score_summary(n, kinds, n_layers, n_heads, lambda lo, hi: {k: v[lo:hi] for k, v in arrays.items()},
                              stats, seed, controlled)


def head_score_summary(n: int, kinds: list[str], n_layers: int, n_heads: int, read: Any, stats: Stats,
                       seed: int, controlled: Sequence[str] = ()) -> pd.DataFrame:
    """One row per (kind, layer, head) from the per-prompt scores read in blocks (read(lo, hi) -> {kind:
    [rows, 4, L, H]}: score, score_tl, chance, control; 3 rows: no control): `score` (mean over the prompts
    with a target position), `score_tl` (mean over all prompts), each with its bootstrap interval over prompts
    (one resampling of the prompts for every kind, head and column), `chance` (mean over the prompts with a
    target position, with its interval), `excess` = score - chance per prompt, tested against 0 (`excess_p`,
    `excess_q` over every row, `significant`), and where a kind has a control: `control` and `over_control`
    = score - control per prompt, each with its interval (`controlled`: the kinds with one); `passes` for every
    row (the module's docstring)."""
    LH = n_layers * n_heads
    L, H = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")

    def block(lo: int, hi: int) -> dict[str, np.ndarray]:
        out = {}
        for k, v in read(lo, hi).items():
            v = np.asarray(v, np.float64).reshape(hi - lo, -1, LH)
            out[k] = v if v.shape[1] > 3 else np.concatenate([v, np.full((hi - lo, 1, LH), np.nan)], axis=1)
        return out

    def stacked(lo: int, hi: int) -> np.ndarray:  # per kind: score then score_tl, each [rows, L x H]
        b = block(lo, hi)
        return np.concatenate([b[k][:, :2].reshape(hi - lo, 2 * LH) for k in kinds], axis=1)

    def excess(lo: int, hi: int) -> np.ndarray:  # per kind: score - chance, [rows, L x H]
        b = block(lo, hi)
        return np.concatenate([b[k][:, 0] - b[k][:, 2] for k in kinds], axis=1)

    def chance(lo: int, hi: int) -> np.ndarray:  # per kind: the chance score, one column (equal over heads)
        b = block(lo, hi)
        return np.stack([b[k][:, 2, 0] for k in kinds], axis=1)
    width = 2 * LH * len(kinds)
    # score and score_tl are not tested (a score is >= 0): their p is not refined; the excess's is (one
    # resampling of the prompts for both: the same seed)
    untested = stats.model_copy(update={"refine_p": False})
    summary = summarise(streamed_mean(n, width, stacked), untested, seed)
    tested = summarise(streamed_mean(n, LH * len(kinds), excess), stats, seed)
    level = summarise(streamed_mean(n, len(kinds), chance), untested, seed)
    test_cols = interval_columns(tested, "excess", stats, test=True)
    counts = column_moments(n, width, stacked).count
    controlled = [k for k in kinds if k in controlled]

    def against_control(lo: int, hi: int) -> np.ndarray:  # per controlled kind: control, then score - control
        b = block(lo, hi)
        return np.concatenate([np.concatenate([b[k][:, 3], b[k][:, 0] - b[k][:, 3]], axis=1) for k in controlled],
                              axis=1)
    ctrl = summarise(streamed_mean(n, 2 * LH * len(controlled), against_control), untested, seed) if controlled \
        else None
    tables = []
    for i, kind in enumerate(kinds):
        table = pd.DataFrame({"kind": kind, "layer": L.reshape(-1), "head": H.reshape(-1),
                              "site": [naming.head(a, b) for a, b in zip(L.reshape(-1), H.reshape(-1))]})
        for j, col in enumerate(("score", "score_tl")):
            part = slice((2 * i + j) * LH, (2 * i + j + 1) * LH)
            table[col] = summary.value[part]
            for key, value in interval_columns(summary, col, stats).items():
                table[key] = value[part]
            if col == "score":
                table["n_prompts"] = counts[part].astype(int)
        part = slice(i * LH, (i + 1) * LH)
        table["excess"] = tested.value[part]
        table["chance"] = level.value[i]  # the mean chance over the prompts with a target (= score - excess)
        for key, value in interval_columns(level, "chance", stats).items():
            table[key] = value[i]
        for key, value in test_cols.items():
            table[key] = np.asarray(value)[part]
        if ctrl is not None:
            c = controlled.index(kind) if kind in controlled else None
            for j, col in enumerate(("control", "over_control")):
                part = slice((2 * c + j) * LH, (2 * c + j + 1) * LH) if c is not None else None
                table[col] = ctrl.value[part] if part else np.nan
                for key, value in interval_columns(ctrl, col, stats).items():
                    table[key] = np.asarray(value)[part] if part else np.nan
        table["ci_level"] = stats.ci_level
        table["passes"] = [head_passes(r) for r in table.to_dict("records")]
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


def head_passes(row: dict[str, Any]) -> bool:
    """A head of its kind by the test docs/pages.md writes: with a control, `over_control`'s interval lies
    wholly above CONTROL_MARGIN (results/claims.py `clears`); else the `most` rule on `score`."""
    if np.isfinite(row.get("over_control", np.nan)):
        return clears(row.get("over_control_ci_low"))
    return most(row["score"], row.get("score_ci_low"))


def _figures(result: Result) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    figs = []
    for kind, sub in result.table.groupby("kind", sort=False):
        grid = sub.pivot(index="layer", columns="head", values="score")
        hover = sub.assign(_hover=[f"{r['kind'].replace('_', '-')} {r['site']}<br>{hover_value(r, 'score')}"
                                   f"<br>{hover_value(r, 'score_tl')}<br>n = {int(r['n_prompts'])}"
                                   for r in sub.to_dict("records")])
        text = hover.pivot(index="layer", columns="head", values="_hover").reindex(index=grid.index,
                                                                                  columns=grid.columns)
        fig = go.Figure(go.Heatmap(z=grid.values, x=[f"h{h}" for h in grid.columns], y=list(grid.index),
                                   zmin=0, zmax=1, colorscale="Viridis", texttemplate="%{z:.2f}",
                                   customdata=text.values, hovertemplate="%{customdata}<extra></extra>",
                                   colorbar={"title": SCALE_TITLE}))
        fig.update_layout(xaxis_title="head", yaxis_title="layer", height=120 + 40 * len(grid))
        figs.append((f"{kind.replace('_', '-')} score (hover: the {level_text(sub)} interval over prompts)", fig))
    return figs
