"""Where each patch writes: units -> members -> slots, as index tensors over whole batches.

A unit (one row of the site table) has members: one activation (kind, layer) and, for each of the
activation's index axes (everything but the feature axes d_model/d_head), either one index or the
whole axis. Members of all units that share an activation and a pattern of whole axes form a
`MemberGroup`; for a batch of rows (example, unit) a group expands to `Slots`, one per (row,
member), vectorised: no Python loop over rows. `grid_index` turns slots into the advanced index of
an activation tensor [batch, *axes], so one gather or one write serves every slot:

    X[grid_index(...)] -> [N, *sizes of the whole axes, *feature axes]

Grouped-query attention: k and v have one head per key/value head. A k/v member picked by query
head h patches key/value head h // group_size (the whole group) in kv_mode "group", or only query
head h's own copy in kv_mode "query_head" (`Member.query_head`; see exact.py for how).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import SiteError
from ..models.names import KINDS, ActName
from ..models.structure import Structure
from ..sites import SiteSet, resolve_positions

FEATURE_AXES = frozenset({"d_model", "d_head", "one", "vocab"})
POSITION_AXES = ("pos", "query_pos", "key_pos")
SHIFTED_AXES = ("pos", "query_pos")  # axes a partial run starts at its first position (key_pos stays whole)


def index_axes(kind: str) -> tuple[str, ...]:
    return tuple(a for a in KINDS[kind].axes if a not in FEATURE_AXES)


@dataclass(frozen=True)
class Member:
    """One activation of a unit and, per index axis, an index or None (the whole axis)."""

    act: ActName
    fixed: tuple[int | None, ...]
    query_head: int | None = None  # k/v in kv_mode "query_head": the query head whose copy is patched


def unit_members(siteset: SiteSet, s: Structure, kv_mode: str) -> list[tuple[Member, ...]]:
    """The members of every unit of a resolved site set."""
    kind = siteset.kind
    axes = index_axes(kind.name)
    out = []
    for unit in siteset.units:
        members = []
        for coord in unit.members:
            d = dict(coord)
            act = siteset.act_name(d.get("layer"))
            query_head = None
            if kind.name in ("k", "v") and "head" in d:
                if "kv_head" in d:
                    raise SiteError(f"{unit.label}: give a query head or a key/value head, not both",
                                    code="kv_head_and_head", remedy="use over: [layer, head] or [layer, kv_head]")
                d["kv_head"] = d["head"] // s.group_size
                if kv_mode == "query_head" and s.group_size > 1:
                    query_head = d["head"]
            members.append(Member(act, tuple(d.get(a) for a in axes), query_head))
        out.append(tuple(members))
    return out


@dataclass
class MemberGroup:
    """Members of every unit that share an activation and which axes they take whole.

    Member arrays are sorted by unit; `starts`/`counts` index them per unit (CSR).
    """

    act: ActName
    axes: tuple[str, ...]
    whole: tuple[bool, ...]
    query_head: bool
    unit: Tensor  # [M]
    fixed: Tensor  # [M, n_axes] (0 on whole axes; positions may be negative)
    head: Tensor  # [M] query head (query_head groups), else -1
    ordinal: Tensor  # [M] the member's index within its unit (keys of per-member random draws)
    starts: Tensor  # [U]
    counts: Tensor  # [U]

    def expand(self, unit_rows: Tensor) -> tuple[Tensor, Tensor]:
        """For rows with these units: (row of each slot [N], member of each slot [N])."""
        counts = self.counts[unit_rows]
        row = torch.repeat_interleave(torch.arange(len(unit_rows)), counts)
        first = torch.repeat_interleave(self.starts[unit_rows], counts)
        offset = torch.arange(len(row)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        return row, first + offset

    def position_columns(self) -> list[int]:
        return [j for j, a in enumerate(self.axes) if a in POSITION_AXES and not self.whole[j]]


def member_groups(members: list[tuple[Member, ...]]) -> list[MemberGroup]:
    """Group the members of all units (in a fixed order: by activation, then pattern)."""
    buckets: dict[tuple, list[tuple[int, int, Member]]] = defaultdict(list)
    for u, unit in enumerate(members):
        for i, m in enumerate(unit):
            key = (m.act, tuple(v is None for v in m.fixed), m.query_head is not None)
            buckets[key].append((u, i, m))
    groups = []
    n_units = len(members)
    for (act, whole, qh), items in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        unit = torch.tensor([u for u, _, _ in items], dtype=torch.long)
        fixed = torch.tensor([[0 if v is None else v for v in m.fixed] for _, _, m in items], dtype=torch.long)
        head = torch.tensor([-1 if m.query_head is None else m.query_head for _, _, m in items], dtype=torch.long)
        ordinal = torch.tensor([i for _, i, _ in items], dtype=torch.long)
        counts = torch.bincount(unit, minlength=n_units)
        starts = torch.cumsum(counts, 0) - counts
        groups.append(MemberGroup(act, index_axes(act.kind), whole, qh, unit, fixed.view(len(items), -1), head,
                                  ordinal, starts, counts))
    return groups


@dataclass
class Slots:
    """One (row, member) pair per slot, with the target indices resolved for each row's example."""

    group: MemberGroup
    row: Tensor  # [N] row within the batch
    ex: Tensor  # [N] example within the chunk
    unit: Tensor  # [N]
    member: Tensor  # [N] index into the group's member arrays
    target: Tensor  # [N, n_axes] absolute indices (negative positions resolved per example)

    def __len__(self) -> int:
        return len(self.row)

    @property
    def head(self) -> Tensor:
        return self.group.head[self.member]

    @property
    def ordinal(self) -> Tensor:
        return self.group.ordinal[self.member]


def make_slots(group: MemberGroup, ex_rows: Tensor, unit_rows: Tensor, base_len: Tensor,
               base_roles: Tensor | None = None) -> Slots:
    """The slots of `group` for rows (example [R], unit [R]); base_len [C] gives each example's length and
    base_roles [C, R] its role positions (negative and role positions are resolved per example)."""
    row, member = group.expand(unit_rows)
    ex = ex_rows[row]
    target = group.fixed[member].clone()
    for j in group.position_columns():
        target[:, j] = resolve_positions(target[:, j], base_len[ex], None if base_roles is None else base_roles[ex])
    return Slots(group, row, ex, unit_rows[row], member, target)


UNCHANGED = 2**62  # row_starts of a row whose patch writes only what its base run already holds


def row_starts(groups: list[MemberGroup], ex_rows: Tensor, unit_rows: Tensor, base_len: Tensor,
               base_roles: Tensor | None = None, shared: Tensor | None = None) -> Tensor:
    """First position each row's patch can change: min over its members ([R]; 0 for whole positions).

    shared [C]: per example, the first position where the base and source prompts differ, when the patch
    value copies the source run (`PatchValue.copies_source`): every activation before it is the same in
    both runs (causal attention), so a member at an earlier position writes nothing new and a member over
    every position changes nothing before it. A row none of whose members changes anything: UNCHANGED.
    (Query-head copies of k/v over every key position keep 0: their edits index all keys.)"""
    out = torch.full((len(ex_rows),), UNCHANGED, dtype=torch.long)
    for g in groups:
        slots = make_slots(g, ex_rows, unit_rows, base_len, base_roles)
        if not len(slots):
            continue
        axes = [j for j, a in enumerate(g.axes) if a in SHIFTED_AXES]
        p0 = None if shared is None else shared[slots.ex]
        if not axes:
            first = torch.zeros(len(slots), dtype=torch.long)
        elif g.whole[axes[0]]:
            first = torch.zeros(len(slots), dtype=torch.long)
            if p0 is not None and not g.query_head:
                first = torch.where(p0 < base_len[slots.ex], p0, UNCHANGED)
        else:
            first = slots.target[:, axes[0]]
            if p0 is not None:
                first = torch.where(first < p0, UNCHANGED, first)
        out.scatter_reduce_(0, slots.row, first, reduce="amin")
    return out


def slots_from(slots: Slots, position: int) -> Slots:
    """The slots of a run starting at `position`, less those fixed at an earlier position (rows start at
    their first changed position, so such a slot writes what the run already holds: `row_starts`)."""
    axes = [j for j, a in enumerate(slots.group.axes) if a in SHIFTED_AXES]
    if not position or not axes or slots.group.whole[axes[0]]:
        return slots
    keep = slots.target[:, axes[0]] >= position
    if bool(keep.all()):
        return slots
    return Slots(slots.group, slots.row[keep], slots.ex[keep], slots.unit[keep], slots.member[keep],
                 slots.target[keep])


def from_position(slots: Slots, index: tuple[Tensor, ...], values: Tensor,
                  position: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """A write over every position (index from `grid_index` with run_offset=position, values [N, *whole,
    *features]) cut to the positions a run starting at `position` holds."""
    g = slots.group
    whole = [a for a, w in zip(g.axes, g.whole) if w]
    shifted = [k for k, a in enumerate(whole) if a in SHIFTED_AXES]
    if not position or not shifted:
        return index, values
    dim = 1 + shifted[0]
    index = tuple(i.narrow(dim, position, i.shape[dim] - position) if i.shape[dim] > 1 else i for i in index)
    return index, values.narrow(dim, position, values.shape[dim] - position)


def grid_index(slots: Slots, batch: Tensor, sizes: dict[str, int], *, position: Tensor | None = None,
               shift: Tensor | None = None, limit: int | None = None, run_offset: int = 0,
               ) -> tuple[Tensor, ...]:
    """Advanced index of a [batch, *axes] tensor for every slot: shapes broadcast to [N, *whole sizes].

    batch:      [N] which batch row of the tensor each slot reads/writes.
    sizes:      size of each whole axis in the grid (positions: the target's padded length).
    position:   [N, n_axes] indices to use instead of slots.target on the fixed position axes.
    shift:      [N] added to whole position axes (alignment of a source of another length).
    limit:      clamp position indices into 0..limit-1 (a source's padded length).
    run_offset: subtracted from pos/query_pos indices (a partial run starting at that position).
    """
    g = slots.group
    n = len(slots)
    whole_axes = [a for a, w in zip(g.axes, g.whole) if w]
    lead = [1] * len(whole_axes)
    out = [batch.view(n, *lead)]
    k = 0
    target = slots.target if position is None else position
    for j, (axis, whole) in enumerate(zip(g.axes, g.whole)):
        is_pos = axis in POSITION_AXES
        if whole:
            shape = [1] * (1 + len(whole_axes))
            shape[1 + k] = sizes[axis]
            idx = torch.arange(sizes[axis]).view(shape)
            if is_pos and shift is not None:
                idx = idx + shift.view(n, *lead)
            k += 1
        else:
            idx = target[:, j].view(n, *lead)
        if is_pos and limit is not None:
            idx = idx.clamp(0, limit - 1)
        if axis in SHIFTED_AXES and run_offset:
            idx = idx - run_offset
        out.append(idx)
    return tuple(out)


def grid_shape(group: MemberGroup, sizes: dict[str, int], feature_sizes: dict[str, int]) -> tuple[int, ...]:
    """Shape of one slot's value: [*whole axis sizes, *feature sizes]."""
    whole = [sizes[a] for a, w in zip(group.axes, group.whole) if w]
    feats = [feature_sizes[a] for a in KINDS[group.act.kind].axes if a in FEATURE_AXES]
    return tuple(whole + feats)


def unit_layers(members: list[tuple[Member, ...]]) -> Tensor:
    """First layer each unit touches ([U]; -1 for model-level activations such as embed)."""
    out = []
    for unit in members:
        layers = [m.act.layer for m in unit]
        out.append(-1 if any(L is None for L in layers) else min(layers))
    return torch.tensor(out, dtype=torch.long)
