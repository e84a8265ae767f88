"""What a batch of patched runs writes: slot values, and ONE intervention per activation name.

`Setup` is everything `prepare` resolved that the engines share. `slot_values` asks the patch
value for the values of a set of slots (fetching base/source/mean/partner activations with one
advanced index each). `Edits` gathers, for one batched run, every write into each activation:
index writes (all rows at once), derived edits (a query head's own copy of k/v, the leaves of
integrated gradients) and captures of activations later edits need.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import CheckFailedError
from ..metrics import MetricFn
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import KINDS, ActName
from ..models.partial import PrefixSupport
from .references import Chunk, source_positions
from .slots import POSITION_AXES, MemberGroup, Slots, grid_index, grid_shape
from .values import PatchInputs, PatchValue


@dataclass
class Setup:
    """The resolved config the engines share (built by Patching.prepare)."""

    model: ModelAdapter
    groups: list[MemberGroup]
    value_names: list[ActName]  # per group: the activation its values are read from (rot_k for query-head keys)
    n_units: int
    unit_layer: Tensor  # [U] first layer of each unit (-1: model-level)
    patch: PatchValue
    params: dict[str, Any]
    needs: frozenset[str]
    metric: MetricFn
    align: str
    source_position: int | None
    seed: int
    path: PrefixSupport
    with_source: bool
    answer_logits_only: bool = False  # the metric reads the answers' and wrong answers' logits only
    means: dict[ActName, Tensor] = field(default_factory=dict)
    unit_labels: list[str] = field(default_factory=list)  # site label of each unit (named in errors)

    @property
    def feature_sizes(self) -> dict[str, int]:
        s = self.model.structure
        return {"d_model": s.d_model, "d_head": s.d_head, "one": 1, "vocab": s.d_vocab}

    def sizes(self, seq_len: int) -> dict[str, int]:
        s = self.model.structure
        features = [g.act for g in self.groups if g.act.kind == "features"]  # one width per site set
        return {"pos": seq_len, "query_pos": seq_len, "key_pos": seq_len, "head": s.n_heads,
                "kv_head": s.n_kv_heads, "neuron": s.d_mlp,
                "feature": self.model.axis_sizes(features[0])["feature"] if features else 0}


def answer_columns(setup: Setup, chunk: Chunk, ex: Tensor) -> Tensor | None:
    """The token ids whose logits the metric reads for rows `ex` (sorted), or None when it reads them all."""
    if not setup.answer_logits_only:
        return None
    ids = torch.cat([chunk.answers[ex], chunk.wrong[ex]], 1).flatten()
    return torch.unique(ids[ids >= 0])


def score_rows(metric: MetricFn, chunk: Chunk, ex: Tensor, logits: Tensor, columns: Tensor | None = None) -> Tensor:
    """The metric of patched rows (logits at their answer positions), each against its example. With
    `columns`, logits holds only those token ids' logits (`answer_columns`)."""
    dev = logits.device
    answers, wrong = chunk.answers[ex].to(dev), chunk.wrong[ex].to(dev)
    if columns is not None:
        cols = columns.to(dev)
        answers, wrong = (torch.where(ids >= 0, torch.searchsorted(cols, ids.clamp(min=0)), ids)
                          for ids in (answers, wrong))
    return metric(logits, answers, wrong, chunk.reference[ex].to(dev))


def _position_dim(name: ActName) -> int:
    axes = KINDS["k" if name.kind == "rot_k" else "q" if name.kind == "rot_q" else name.kind].axes
    return 1 + [a in POSITION_AXES for a in axes].index(True)


def slot_values(setup: Setup, chunk: Chunk, slots: Slots, group_index: int) -> Tensor:
    """The patch value of every slot: [N, *whole axis sizes, *feature sizes]."""
    g = setup.groups[group_index]
    name = setup.value_names[group_index]
    T = chunk.base_tokens.shape[1]
    sizes = setup.sizes(T)
    shape = (len(slots),) + grid_shape(g, sizes, setup.feature_sizes)
    ex = slots.ex

    def fetch(run: str) -> Tensor:
        if run == "mean":
            X = setup.means[name][None]
            zeros = torch.zeros_like(ex)
            return X[grid_index(slots, zeros, sizes, limit=X.shape[_position_dim(name)])]
        X = chunk.acts["resample" if run == "resample" else run][name]
        if run == "base":
            return X[grid_index(slots, ex, sizes)]
        other_len = chunk.partner_len if run == "resample" else chunk.source_len
        assert other_len is not None
        pos, shift = source_positions(slots, chunk.base_len[ex], other_len[ex], setup.align, setup.source_position)
        return X[grid_index(slots, ex, sizes, position=pos, shift=shift, limit=X.shape[_position_dim(name)])]

    keys = torch.stack([chunk.index[ex], slots.unit, slots.ordinal], 1)
    dtype = next(setup.model.module.parameters()).dtype
    inputs = PatchInputs(shape, dtype, setup.model.device, fetch, keys, setup.seed)
    values = setup.patch.fn(inputs, **setup.params)
    if tuple(values.shape) != shape:
        raise CheckFailedError(f"patch value {setup.patch.name!r} returned shape {tuple(values.shape)} for "
                               f"slots of shape {shape}", code="patch_value_shape",
                               remedy="a patch value returns a tensor shaped like inputs.shape")
    return values


class Edits:
    """Every change one batched run makes, as one intervention per activation name."""

    def __init__(self) -> None:
        self._writes: dict[ActName, list[tuple[tuple[Tensor, ...], Tensor]]] = defaultdict(list)
        self._derived: dict[ActName, list[Callable[[Tensor, dict[ActName, Tensor]], Tensor]]] = defaultdict(list)
        self._capture: set[ActName] = set()
        self.captured: dict[ActName, Tensor] = {}

    def write(self, act: ActName, index: tuple[Tensor, ...], values: Tensor) -> None:
        self._writes[act].append((index, values))

    def derive(self, act: ActName, fn: Callable[[Tensor, dict[ActName, Tensor]], Tensor]) -> None:
        self._derived[act].append(fn)

    def capture(self, act: ActName) -> None:
        self._capture.add(act)

    def interventions(self) -> list[Intervention]:
        names = sorted(set(self._writes) | set(self._derived) | self._capture)
        return [Intervention(act, self._fn(act)) for act in names]

    def _fn(self, act: ActName) -> Callable[[Tensor], Tensor]:
        writes, derived, keep = self._writes.get(act, []), self._derived.get(act, []), act in self._capture

        def fn(x: Tensor) -> Tensor:
            if writes:
                x = x.clone()
                for index, values in writes:
                    x[tuple(i.to(x.device) for i in index)] = values.to(x.device, x.dtype)
            for edit in derived:
                x = edit(x, self.captured)
            if keep:
                self.captured[act] = x
            return x
        return fn
