"""Exact patching, batched: many (prompt, patch) rows in one forward, each starting where it can.

Every row is one example patched at one unit. A row's patch can change nothing before its first
layer L and, under causal attention, its first position p; the row then runs blocks L.. on positions
p.. only (`models.partial`: HookedTransformer and TransformerBridge alike), from the base runs'
cached residual stream and keys/values, and logits are read at the answer positions alone. Rows are
grouped by first position (a small dynamic programme over the sorted start positions: a batch costs
a fixed overhead per block call plus, per row, (n_layers - L) x (T - P) token-blocks, P the batch's
first position); within a batch, rows enter the run at their own first layer, so a batch's matrices
grow as it goes deeper. On a model that cannot start part-way (`prefix_support` "none") every batch
is a full forward of the rows' base prompts.

When the patch value copies the source run (`copies_source`: patch "source"), nothing changes before
the first token where a pair's prompts differ (causal attention: every activation there is the same in
both runs), so a row patched over every position starts there, and a row patched only at earlier
positions changes nothing: it runs nowhere and its metric is the base run's (`RowBatch.unchanged`).

All writes into one activation are one intervention that indexes rows (`writes.Edits`); values
come from the unpatched runs (`writes.slot_values`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import CheckFailedError
from ..models.names import ActName
from ..metrics import metric_where
from ..models.partial import attention_scale, logits_at, slice_start
from .references import Chunk
from .slots import UNCHANGED, Slots, from_position, grid_index, make_slots, row_starts, slots_from
from .writes import Edits, Setup, answer_columns, score_rows, slot_values

# What one more block call costs, in token-blocks (one position through one block): the weights streamed
# from memory once per call (about as much as BLOCK_STREAM tokens of work on a CPU) plus a fixed Python and
# hook overhead of about BLOCK_CALL_MACS multiply-adds. Measured on GPT-2-small-sized models (about 25).
BLOCK_STREAM = 16
BLOCK_CALL_MACS = 6e7


@dataclass
class RowBatch:
    """Rows (example in the chunk, unit) run together from position `position`, each from its own first
    block `layers[i]` (sorted: rows with later layers join the run there; -1: a full run)."""

    ex: Tensor
    unit: Tensor
    layers: Tensor
    position: int
    unchanged: bool = False  # rows whose patch writes only what the base run holds: the base metric, no run

    @property
    def layer(self) -> int:
        """The first block the batch runs (-1: full runs)."""
        return int(self.layers[0])

    def __len__(self) -> int:
        return len(self.ex)


def block_overhead(setup: Setup) -> float:
    """One block call's fixed cost, in token-blocks (see BLOCK_STREAM)."""
    s = setup.model.structure
    per_token = 2 * s.d_model * s.d_head * (s.n_heads + s.n_kv_heads) + s.d_model * s.d_mlp * (3 if s.gated_mlp else 2)
    return BLOCK_STREAM + BLOCK_CALL_MACS / max(1, per_token)


def schedule(setup: Setup, base_len: Tensor, max_rows: int, base_roles: Tensor | None = None,
             shared: Tensor | None = None) -> list[RowBatch]:
    """Every (example, unit) row of a chunk, in batches of at most `max_rows`.

    Rows whose patch changes nothing (`row_starts` UNCHANGED, given `shared`: each example's first
    position where its base and source prompts differ) form one batch that runs nowhere. Rows that start
    part-way are grouped by their first position (a dynamic programme over the sorted start positions,
    `_split`); within a group rows are sorted by first layer and run together, each joining the run at
    its own layer. Rows of model-level units (layer -1) run full forwards."""
    C, U = len(base_len), setup.n_units
    ex = torch.arange(C).repeat_interleave(U)
    unit = torch.arange(U).repeat(C)
    batches: list[RowBatch] = []
    starts = None
    if setup.path == "positions" or shared is not None:
        starts = row_starts(setup.groups, ex, unit, base_len, base_roles, shared)
        same = starts == UNCHANGED
        if bool(same.any()):
            batches.append(RowBatch(ex[same], unit[same], torch.full_like(ex[same], -1), 0, unchanged=True))
            ex, unit, starts = ex[~same], unit[~same], starts[~same]
    if setup.path == "none":
        layer = torch.full_like(ex, -1)
    else:
        layer = setup.unit_layer[unit]
    full = layer < 0
    batches += [RowBatch(ex[full][i:i + max_rows], unit[full][i:i + max_rows], layer[full][i:i + max_rows], 0)
                for i in range(0, int(full.sum()), max_rows)]
    ex, unit, layer = ex[~full], unit[~full], layer[~full]
    if not len(ex):
        return batches
    if setup.path == "positions":
        assert starts is not None
        start = torch.minimum(starts[~full], base_len[ex] - 1)
    else:
        start = torch.zeros_like(ex)
    T, n = int(base_len.max()), setup.model.structure.n_layers
    order = torch.argsort(start * (n + 1) + layer, stable=True)
    ex, unit, layer, start = ex[order], unit[order], layer[order], start[order]
    for a, b in _split(start, layer, T, n, max_rows, block_overhead(setup)):
        by_layer = a + torch.argsort(layer[a:b], stable=True)
        for i in range(0, b - a, max_rows):
            rows = by_layer[i:i + max_rows]
            batches.append(RowBatch(ex[rows], unit[rows], layer[rows], int(start[a])))
    return batches


def _split(starts: Tensor, layers: Tensor, T: int, n_layers: int, max_rows: int,
           overhead: float) -> list[tuple[int, int]]:
    """Split rows sorted by start position into runs [a, b) minimising the sum over runs of
    (blocks walked x overhead per block call) + sum over rows of (n_layers - layer) x (T - first start)."""
    n = len(starts)
    values, counts = torch.unique_consecutive(starts, return_counts=True)
    k = len(values)
    if k == 1 or k > 512:
        return [(0, n)]
    cum = [0] + torch.cumsum(counts, 0).tolist()
    work = [0] + torch.cumsum(n_layers - layers, 0).tolist()  # token-blocks per position, cumulated
    low = [int(layers[cum[i]:cum[i + 1]].min()) for i in range(k)]  # first layer among each start's rows
    v = values.tolist()
    best = [0.0] + [math.inf] * k
    back = [0] * (k + 1)
    for j in range(1, k + 1):
        first = n_layers
        for i in range(j - 1, -1, -1):
            first = min(first, low[i])
            rows = cum[j] - cum[i]
            cost = (best[i] + math.ceil(rows / max_rows) * (n_layers - first) * overhead
                    + (work[cum[j]] - work[cum[i]]) * (T - v[i]))
            if cost < best[j]:
                best[j], back[j] = cost, i
    cuts, j = [], k
    while j > 0:
        cuts.append((cum[back[j]], cum[j]))
        j = back[j]
    return cuts[::-1]


def exact_chunk(setup: Setup, chunk: Chunk, batches: list[RowBatch], tick: Callable[[], None]) -> Tensor:
    """Patched metric of every (example, unit) of the chunk: [C, U] (float64)."""
    model = setup.model
    out = torch.full((len(chunk), setup.n_units), float("nan"), dtype=torch.float64)
    base = chunk.acts["base"]
    with torch.no_grad():
        for b in batches:
            if b.unchanged:
                out[b.ex, b.unit] = chunk.m_base[b.ex.to(chunk.m_base.device)].double().cpu()
                tick()
                continue
            edits = build_edits(setup, chunk, b)
            positions = chunk.last[b.ex] - b.position
            ivs = edits.interventions()
            columns = answer_columns(setup, chunk, b.ex)
            if b.layer < 0:
                logits = logits_at(model, positions, tokens=chunk.base_tokens[b.ex], interventions=ivs, columns=columns)
            else:
                start = slice_start(base, b.ex.to(model.device), b.layers, b.position, model.structure.n_layers)
                logits = logits_at(model, positions, start=start, interventions=ivs, columns=columns)
            units = sorted(set(b.unit.tolist()))
            sites = [setup.unit_labels[u] for u in units[:4]] if setup.unit_labels else units[:4]
            with metric_where(f"patched rows of site(s) {', '.join(map(str, sites))}"
                              f"{' ...' if len(units) > 4 else ''}"):
                out[b.ex, b.unit] = score_rows(setup.metric, chunk, b.ex, logits, columns).double().cpu()
            tick()
    return out


def build_edits(setup: Setup, chunk: Chunk, b: RowBatch) -> Edits:
    """One intervention per activation for the batch: every slot's value written where it belongs."""
    edits = Edits()
    T = chunk.base_tokens.shape[1]
    sizes = setup.sizes(T)
    for gi, g in enumerate(setup.groups):
        slots = slots_from(make_slots(g, b.ex, b.unit, chunk.base_len, chunk.base_roles), b.position)
        if not len(slots):
            continue
        values = slot_values(setup, chunk, slots, gi)
        if not g.query_head:
            index = grid_index(slots, slots.row, sizes, run_offset=b.position)
            edits.write(g.act, *from_position(slots, index, values, b.position))
        elif g.act.kind == "v":
            _query_head_v(edits, slots, values, T)
        else:
            _query_head_k(setup, edits, slots, values, T, rotary=setup.value_names[gi].kind == "rot_k")
    return edits


def _key_positions(slots: Slots, T: int) -> Tensor:
    """[N, K] key positions a query-head k/v slot patches (one, or every position)."""
    j = slots.group.axes.index("pos")
    if slots.group.whole[j]:
        return torch.arange(T).expand(len(slots), T)
    return slots.target[:, j:j + 1]


def _query_head_v(edits: Edits, slots: Slots, values: Tensor, T: int) -> None:
    """Query head h's own copy of v: z_h += sum over patched keys of pattern_h(q, key) (v_new - v)."""
    L = slots.group.act.layer
    row, head = slots.row, slots.head
    kv = slots.target[:, slots.group.axes.index("kv_head")]
    keys = _key_positions(slots, T)
    new = values.reshape(len(slots), keys.shape[1], -1)
    pattern, v_name = ActName("pattern", L), ActName("v", L)
    edits.capture(pattern)
    edits.capture(v_name)

    def edit(z: Tensor, seen: dict[ActName, Tensor]) -> Tensor:
        p, v = seen[pattern], seen[v_name]
        dev = z.device
        r, h, k = row.to(dev), head.to(dev), keys.to(dev)
        old = v[r[:, None], k - (p.shape[-1] - v.shape[1]), kv.to(dev)[:, None]]  # [N, K, d_head]
        weight = p[r[:, None], h[:, None], :, k]  # [N, K, Tq]
        change = torch.einsum("nkq,nkd->nqd", weight, new.to(dev, z.dtype) - old)
        tq = torch.arange(z.shape[1], device=dev)
        return z.index_put((r[:, None], tq[None, :], h[:, None]), change, accumulate=True)
    edits.derive(ActName("z", L), edit)


def _query_head_k(setup: Setup, edits: Edits, slots: Slots, values: Tensor, T: int, rotary: bool) -> None:
    """Query head h's own copy of k: scores_h(q, key) += q_h . (k_new - k) / scale at the patched keys.

    Under rotary the values are rotated keys (read from the hook after rotary), so q and k are the
    rotated ones; the scale is checked against the run's own scores before any edit."""
    L = slots.group.act.layer
    row, head = slots.row, slots.head
    kv = slots.target[:, slots.group.axes.index("kv_head")]
    keys = _key_positions(slots, T)
    new = values.reshape(len(slots), keys.shape[1], -1)
    q_name = ActName("rot_q" if rotary else "q", L)
    k_name = ActName("rot_k" if rotary else "k", L)
    edits.capture(q_name)
    edits.capture(k_name)
    scale = attention_scale(setup.model)

    def edit(scores: Tensor, seen: dict[ActName, Tensor]) -> Tensor:
        q, k = seen[q_name], seen[k_name]
        dev = scores.device
        r, h, key = row.to(dev), head.to(dev), keys.to(dev)
        Tq, Tk = scores.shape[-2], scores.shape[-1]
        old = k[r[:, None], key - (Tk - k.shape[1]), kv.to(dev)[:, None]]  # [N, K, d_head]
        qh = q[r, :, h]  # [N, Tq, d_head]
        own = torch.einsum("nqd,nkd->nqk", qh, old) / scale
        seen_scores = scores[r[:, None], h[:, None], :, key].transpose(1, 2)  # [N, Tq, K]
        causal = key[:, None, :] <= (torch.arange(Tq, device=dev) + Tk - Tq)[None, :, None]
        gap = (own - seen_scores).abs().masked_fill(~causal, 0).max() if causal.any() else own.new_zeros(())
        if float(gap) > 1e-3 * (1 + float(own.abs().max())):
            raise CheckFailedError(
                f"patching a query head's own key copy at layer {L}: q.k/{scale:.4g} differs from this model's "
                f"attention scores by {float(gap):.3g}", code="query_head_scores_mismatch",
                remedy="use kv_mode: group on this model (its attention scores are not q.k/sqrt(d_head))")
        change = torch.einsum("nqd,nkd->nqk", qh, new.to(dev, qh.dtype) - old) / scale
        tq = torch.arange(Tq, device=dev)
        return scores.index_put((r[:, None, None], h[:, None, None], tq[None, :, None], key[:, None, :]),
                                change.to(scores.dtype), accumulate=True)
    edits.derive(ActName("attn_scores", L), edit)
