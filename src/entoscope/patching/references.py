"""The unpatched runs every method starts from: base and source of each pair, resample partners, means.

Roles (docs/patching.md): denoising runs the corrupt (counterfactual) prompt and patches in the
clean prompt's activations; noising runs the clean prompt and patches in the corrupt's.
Without counterfactuals there is one run per example, the prompt: it is the base (noising).
The answers are always the clean prompt's, so the metric means the same thing in both runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..data.roles import RoleTable
from ..data.tokenized import TokenizedData, pad, pad_answers
from ..errors import DataError, SiteError
from ..metrics import MetricFn, at_positions
from ..models.adapter import ModelAdapter
from ..models.names import KINDS, ActName
from ..models.partial import read_run, record_past
from ..sites import resolve_positions
from .slots import POSITION_AXES, SHIFTED_AXES, MemberGroup, Slots


@dataclass
class Pairs:
    """Token ids of every example by role, and its answers."""

    base: list[list[int]]
    source: list[list[int]] | None  # None: no counterfactuals
    answers: list[list[int]]
    wrong: list[list[int]]
    partner: list[int] | None = None  # resample: the example whose source-role run is used
    base_roles: RoleTable | None = None  # the token of each role in each base run (positions by role)

    @staticmethod
    def from_data(td: TokenizedData, direction: str) -> Pairs:
        answers = td.answers or [[] for _ in td.prompts]
        wrong = td.wrong_answers or [[] for _ in td.prompts]
        if td.counterfactuals is None:
            return Pairs(td.prompts, None, answers, wrong, base_roles=td.roles)
        if direction == "denoising":
            return Pairs(td.counterfactuals, td.prompts, answers, wrong, base_roles=td.cf_roles)
        return Pairs(td.prompts, td.counterfactuals, answers, wrong, base_roles=td.roles)

    def base_role_rows(self, idx: list[int] | Tensor) -> Tensor | None:
        return None if self.base_roles is None else self.base_roles.subset(idx)

    @property
    def source_role(self) -> list[list[int]]:
        """The runs patch values come from: the sources, or the prompts themselves without pairs."""
        return self.source if self.source is not None else self.base

    def shared_prefix(self, align: str) -> Tensor | None:
        """[E] per example, the first position where the base and source prompts differ (the shorter one's
        length when it begins the other): under causal attention both runs hold the same activations
        before it. 0 for a pair aligned by its end whose lengths differ (its positions do not face the
        same prefix); None without pairs."""
        if self.source is None:
            return None
        out = []
        for b, s in zip(self.base, self.source):
            n = min(len(b), len(s))
            if align == "end" and len(b) != len(s):
                out.append(0)
                continue
            out.append(next((i for i in range(n) if b[i] != s[i]), n))
        return torch.tensor(out, dtype=torch.long)

    def base_lengths(self) -> Tensor:
        return torch.tensor([len(t) for t in self.base], dtype=torch.long)

    def source_lengths(self) -> Tensor:
        return torch.tensor([len(t) for t in self.source_role], dtype=torch.long)


def choose_partners(pairs: Pairs, seed: int, same_length: bool) -> list[int]:
    """For each example, another example (seeded draw) whose source-role run is resampled."""
    rng = random.Random(seed)
    by_length: dict[int, list[int]] = {}
    for j, toks in enumerate(pairs.source_role):
        by_length.setdefault(len(toks), []).append(j)
    everyone = list(range(len(pairs.base)))
    out = []
    for e, toks in enumerate(pairs.base):
        pool = by_length.get(len(toks), []) if same_length else everyone
        pool = [j for j in pool if j != e]
        if not pool:
            raise DataError(f"example {e} ({len(toks)} tokens) has no other example "
                            f"{'of its length ' if same_length else ''}to resample from",
                            code="resample_no_partner",
                            remedy="add examples of that length, or give align: start/end so prompts of "
                            "other lengths can be aligned")
        out.append(rng.choice(pool))
    return out


@dataclass
class Chunk:
    """The reference runs of a few examples (right-padded), and what was read from them."""

    index: Tensor  # [C] dataset ids
    base_tokens: Tensor
    base_len: Tensor
    answers: Tensor
    wrong: Tensor
    reference: Tensor  # [C, V] base logits at the answer position (the KL reference)
    m_base: Tensor  # [C]
    m_source: Tensor  # [C] (NaN without pairs)
    source_len: Tensor | None = None
    partner_len: Tensor | None = None
    base_roles: Tensor | None = None  # [C, R] role positions of the base runs
    acts: dict[str, dict[ActName, Tensor]] = field(default_factory=dict)  # run -> activations

    @property
    def last(self) -> Tensor:
        return self.base_len - 1

    def __len__(self) -> int:
        return len(self.index)


def new_chunk(pairs: Pairs, idx: list[int], pad_id: int) -> Chunk:
    """The base tokens and answers of examples `idx` (right-padded); no run yet."""
    base_tokens, base_len = pad([pairs.base[i] for i in idx], pad_id)
    empty = torch.empty(0)
    return Chunk(torch.tensor(idx), base_tokens, base_len, pad_answers([pairs.answers[i] for i in idx]),
                 pad_answers([pairs.wrong[i] for i in idx]), empty, empty, empty, base_roles=pairs.base_role_rows(idx))


def score(metric: MetricFn, chunk: Chunk, logits_at: Tensor, reference: Tensor) -> Tensor:
    """The metric of rows of logits at the answer position, for the chunk's examples."""
    dev = logits_at.device
    return metric(logits_at, chunk.answers.to(dev), chunk.wrong.to(dev), reference)


def run_base(model: ModelAdapter, chunk: Chunk, reads: list[ActName], metric: MetricFn,
             past_from: int | None = None) -> None:
    """The unpatched base runs: activations, the reference logits and the base metric; with `past_from`,
    also what each block from that layer on caches (runs starting at a position read it)."""
    logits, chunk.acts["base"] = read_run(model, chunk.base_tokens, reads)
    if past_from is not None:
        record_past(model, chunk.acts["base"], past_from)
    chunk.reference = at_positions(logits, chunk.last).detach()
    chunk.m_base = score(metric, chunk, chunk.reference, chunk.reference).detach()


def run_sources(model: ModelAdapter, chunk: Chunk, pairs: Pairs, reads: dict[str, list[ActName]],
                metric: MetricFn, pad_id: int, *, with_source: bool) -> None:
    """The source runs of the pairs (metric and activations) and the resample partners' runs."""
    idx = chunk.index.tolist()
    chunk.m_source = torch.full_like(chunk.m_base, float("nan"))
    if with_source or reads.get("source"):
        tokens, chunk.source_len = pad([pairs.source_role[i] for i in idx], pad_id)
        logits, chunk.acts["source"] = read_run(model, tokens, reads.get("source", []))
        if with_source:
            chunk.m_source = score(metric, chunk, at_positions(logits, chunk.source_len - 1), chunk.reference)
        del logits
    if reads.get("resample"):
        assert pairs.partner is not None
        tokens, chunk.partner_len = pad([pairs.source_role[pairs.partner[i]] for i in idx], pad_id)
        _, chunk.acts["resample"] = read_run(model, tokens, reads["resample"])


def dataset_means(model: ModelAdapter, pairs: Pairs, names: list[ActName], per_position: bool, chunk: int,
                  pad_id: int) -> dict[ActName, Tensor]:
    """Mean of each source-role activation over the dataset: [*axes] per absolute position, or over all
    positions (position axes of size 1) when per_position is False. Pads never count."""
    runs = pairs.source_role
    sums: dict[ActName, Tensor] = {}
    counts: dict[ActName, Tensor] = {}
    t_max = max(len(r) for r in runs)
    for start in range(0, len(runs), chunk):
        tokens, lengths = pad(runs[start: start + chunk], pad_id)
        _, acts = read_run(model, tokens, names)
        for name in names:
            x = acts[name].double()
            mask = _real_positions(name, x.shape, lengths.to(x.device))
            s, c = (x * mask).sum(0), mask.expand_as(x).sum(0)
            if not per_position:
                dims = [i for i, a in enumerate(KINDS[name.kind].axes) if a in POSITION_AXES]
                s, c = s.sum(dims, keepdim=True), c.sum(dims, keepdim=True)
            if name not in sums:
                shape = [t_max if (a in POSITION_AXES and per_position) else n
                         for a, n in zip(KINDS[name.kind].axes, s.shape)]
                sums[name] = torch.zeros(shape, dtype=torch.float64, device=x.device)
                counts[name] = torch.zeros(shape, dtype=torch.float64, device=x.device)
            region = tuple(slice(0, n) for n in s.shape)
            sums[name][region] += s
            counts[name][region] += c
    dtype = next(model.module.parameters()).dtype
    return {n: (sums[n] / counts[n].clamp(min=1)).to(dtype) for n in names}


def _real_positions(name: ActName, shape: torch.Size, lengths: Tensor) -> Tensor:
    """[B, ...] mask, broadcastable to `shape`: 1 where every position axis is inside the prompt."""
    mask = torch.ones([shape[0]] + [1] * (len(shape) - 1), dtype=torch.float64, device=lengths.device)
    for i, axis in enumerate(KINDS[name.kind].axes):
        if axis in POSITION_AXES:
            view = [shape[0]] + [1] * (len(shape) - 1)
            view[i + 1] = shape[i + 1]
            inside = torch.arange(shape[i + 1], device=lengths.device)[None, :] < lengths[:, None]
            mask = mask * inside.view(view).double()
    return mask


# ---------------------------------------------------------------------- alignment of positions
def source_positions(slots: Slots, base_len: Tensor, src_len: Tensor, align: str,
                     source_position: int | None) -> tuple[Tensor, Tensor]:
    """Where each slot reads in a source run: (indices [N, n_axes] on fixed axes, shift [N] for whole
    position axes). base_len/src_len are per slot."""
    g = slots.group
    shift = src_len - base_len if align == "end" else torch.zeros_like(base_len)
    pos = slots.target.clone()
    for j, axis in enumerate(g.axes):
        if axis not in POSITION_AXES or g.whole[j]:
            continue
        if source_position is not None and axis in SHIFTED_AXES:
            sp = torch.full_like(src_len, source_position)
            pos[:, j] = torch.where(sp < 0, sp + src_len, sp)
        else:
            pos[:, j] = pos[:, j] + shift
    return pos, shift


def check_alignment(groups: list[MemberGroup], base_len: Tensor, src_len: Tensor, align: str,
                    source_position: int | None, what: str, base_roles: Tensor | None = None) -> None:
    """Refuse, naming the pair, any patched position with no aligned position in its source run."""
    for g in groups:
        cols = [j for j, a in enumerate(g.axes) if a in POSITION_AXES]
        for j in cols:
            if g.whole[j]:
                bad = (src_len < base_len).nonzero().flatten()
                if len(bad):
                    e = int(bad[0])
                    raise SiteError(
                        f"{what} {e}: every position of the {int(base_len[e])}-token base run is patched, but "
                        f"its source run has only {int(src_len[e])} tokens", code="positions_unaligned",
                        remedy="patch chosen positions (sites over: [layer, position]), or make the runs "
                        "the same length")
                continue
            for v in torch.unique(g.fixed[:, j]).tolist():
                t = resolve_positions(torch.full_like(base_len, v), base_len, base_roles)
                if source_position is not None and g.axes[j] in SHIFTED_AXES:
                    s = torch.full_like(src_len, source_position)
                    s = torch.where(s < 0, s + src_len, s)
                else:
                    s = t + (src_len - base_len if align == "end" else 0)
                bad = ((s < 0) | (s >= src_len)).nonzero().flatten()
                if len(bad):
                    e = int(bad[0])
                    raise SiteError(
                        f"{what} {e}: position {int(t[e])} of its {int(base_len[e])}-token base run maps to "
                        f"position {int(s[e])} of its {int(src_len[e])}-token source run, which does not exist",
                        code="positions_unaligned",
                        remedy="choose positions both runs have (negative positions count from the end), "
                        "another align, or another source_position")
