"""Activations of a labelled dataset at any `Sites`, one feature vector per prompt and site, in batches.

Every forward pass goes through `ModelAdapter.run` (so through `CachedModel` when the model is wrapped,
and with interventions for the causal check). Prompts are batched right-padded; pads are never read:
positions count per prompt (negative from each prompt's own end), and the poolings use each prompt's
length. A row of the site set is a unit; a unit that groups several coordinates (or a per-layer kind
read without a layer axis) concatenates its members' features.

What one member contributes, for an activation [B, T, ...]:
  position  the unit's position if the site grid has one, else the pooling over positions;
  head      per-head kinds (z, q, k, v, result): the unit's head, else the head pooling
            (k, v with a query-head index read the key/value head that query head uses);
  neuron    mlp_pre / mlp_post: the unit's neuron (one feature), else every neuron.
  feature   features.L@KEY (Sites with a dictionary): the unit's dictionary feature, else all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import Batch, TokenizedData, make_batches, pad_id, tokenize_data
from ..errors import ConfigError
from ..metrics import at_positions, metric_where
from ..models.adapter import Intervention, ModelAdapter, adapt
from ..models.names import ActName
from ..operation import progress
from ..sites import Sites, SiteSet, absolute_positions
from ..registry import lookup
from .pooling import Pooling, PoolFn, head_pooled_size

UNPROBED_KINDS = {"pattern": "attention patterns", "attn_scores": "attention scores", "logits": "the logits"}
FLOAT = 4  # bytes per activation element assumed by the memory estimates


@dataclass(frozen=True)
class MemberRead:
    """How one coordinate of a unit is read from a batch's activation."""

    act: ActName
    pos: int | None  # the site's position (negative: from each prompt's end); None: pooled over positions
    head: int | None  # index on the activation's head axis; None: the whole axis (head-pooled)
    has_heads: bool  # the kind has a head axis (z, q, k, v, result)
    neuron: int | None
    size: int  # features contributed
    feature: int | None = None  # a dictionary feature (features.L@KEY sites)


@dataclass(frozen=True)
class UnitRead:
    label: str
    members: tuple[MemberRead, ...]

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)


def unit_reads(model: ModelAdapter, siteset: SiteSet, head_pooling: str) -> list[UnitRead]:
    """What each unit reads; refuses kinds that are not one vector per prompt and position."""
    kind = siteset.kind
    if kind.name in UNPROBED_KINDS:
        raise ConfigError(f"{UNPROBED_KINDS[kind.name]} are not probed: they are not one vector per token",
                          code="probe_site_kind",
                          remedy="probe z or result (what each head writes), or resid_* / attn_out / mlp_out")
    s = model.structure
    lookup("head_pooling", head_pooling)  # refuses an unknown name now
    units = []
    for u in siteset.units:
        members = []
        for coord in u.members:
            d = dict(coord)
            layer = d.get("layer")
            act = siteset.act_name(layer)  # features: with the layer's dictionary
            axes = [a for a in kind.axes if a != "pos"]
            has_heads = axes[0] in ("head", "kv_head")
            head = neuron = feature = None
            if has_heads:
                if "kv_head" in d:
                    head = d["kv_head"]
                elif "head" in d:
                    group = s.n_heads // s.n_kv_heads if axes[0] == "kv_head" else 1
                    head = d["head"] // group
                n_on_axis = s.n_kv_heads if axes[0] == "kv_head" else s.n_heads
                width = model.axis_sizes(kind.name)[axes[1]]
                size = width if head is not None else head_pooled_size(head_pooling, n_on_axis, width)
            elif axes == ["neuron"]:
                neuron = d.get("neuron")
                size = 1 if neuron is not None else s.d_mlp
            elif axes == ["feature"]:
                feature = d.get("feature")
                size = 1 if feature is not None else model.axis_sizes(act)["feature"]
            else:
                size = model.axis_sizes(kind.name)[axes[0]]
            members.append(MemberRead(act, d.get("pos"), head, has_heads, neuron, size, feature))
        units.append(UnitRead(u.label, tuple(members)))
    return units


def reads_of(units: list[UnitRead]) -> list[ActName]:
    return sorted({m.act for u in units for m in u.members})


def member_features(x: Tensor, m: MemberRead, lengths: Tensor, pool: PoolFn, at: Tensor | None,
                    head_pool: Callable[[Tensor], Tensor], pooled: dict[ActName, Tensor],
                    roles: Tensor | None = None) -> Tensor:
    """[B, size] features of one member from its activation x [B, T, ...] (pooled values cached per act)."""
    if m.pos is not None:
        v = x[torch.arange(x.shape[0], device=x.device), absolute_positions(m.pos, lengths, roles).to(x.device)]
    else:
        if m.act not in pooled:
            pooled[m.act] = pool(x, lengths.to(x.device), None if at is None else at.to(x.device))
        v = pooled[m.act]
    if m.has_heads:
        v = v[:, m.head] if m.head is not None else head_pool(v)
    elif m.neuron is not None:
        v = v[:, m.neuron: m.neuron + 1]
    elif m.feature is not None:
        v = v[:, m.feature: m.feature + 1]
    return v.reshape(v.shape[0], -1)


@dataclass
class Collected:
    """Features per unit, stored by feature size: buckets[F] is [units of that size, N, F]."""

    buckets: dict[int, Tensor]
    slots: list[tuple[int, int]]  # unit -> (F, index in buckets[F])
    labels: list[str]
    metric: Tensor | None = None  # [N] the task metric at each prompt's last token (when asked)
    bucket_units: dict[int, list[int]] = field(default_factory=dict)  # F -> unit indices, in bucket order

    def features(self, unit: int) -> Tensor:
        F, j = self.slots[unit]
        return self.buckets[F][j]

    def stacked(self) -> Tensor:
        """[S, N, F] when every unit has the same feature size."""
        if len(self.buckets) != 1:
            raise ConfigError(f"units have different feature sizes {sorted(self.buckets)}: no single stack",
                              code="config_invalid", remedy="use Collected.features(unit) or buckets")
        return next(iter(self.buckets.values()))


def empty_collection(units: list[UnitRead], n: int, dtype: torch.dtype, device: torch.device) -> Collected:
    by_size: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        by_size.setdefault(u.size, []).append(i)
    slots: list[tuple[int, int]] = [(0, 0)] * len(units)
    for F, idx in by_size.items():
        for j, i in enumerate(idx):
            slots[i] = (F, j)
    buckets = {F: torch.zeros(len(idx), n, F, dtype=dtype, device=device) for F, idx in by_size.items()}
    return Collected(buckets, slots, [u.label for u in units], bucket_units=by_size)


def collect(model: ModelAdapter, batches: list[Batch], units: list[UnitRead], pool: PoolFn, at: Tensor | None,
            head_pooling: str, n: int, *, device: torch.device | None = None,
            interventions: Callable[[Batch], list[Intervention]] | None = None,
            metric: Callable[..., Tensor] | None = None, quiet: bool = True, desc: str = "collect",
            row_of: dict[int, int] | None = None) -> Collected:
    """Run every batch once and write each unit's features into its bucket (rows in dataset order).

    interventions: per batch, changes made during the run (the features are read after them).
    metric:        a task metric `fn(logits [B, V], answers, wrong, None) -> [B]` read at the last token.
    row_of:        dataset index -> row, when the batches are some of the dataset's (a shard: n rows).
    """
    reads = reads_of(units)
    head_pool = lookup("head_pooling", head_pooling)
    dev = device if device is not None else model.device
    out_store: Collected | None = None
    metric_out = torch.zeros(n, dtype=torch.float64) if metric is not None else None
    with torch.no_grad():
        for b in progress(batches, total=len(batches), desc=desc, quiet=quiet):
            ivs = interventions(b) if interventions is not None else ()
            out = model.run(b.tokens, reads, interventions=ivs, logits=metric is not None)
            pooled: dict[ActName, Tensor] = {}
            b_at = None if at is None else at[b.index]
            local = [row_of[i] for i in b.index] if row_of is not None else list(b.index)
            rows = torch.tensor(local, device=dev)
            for i, u in enumerate(units):
                feats = torch.cat([member_features(out[m.act], m, b.lengths, pool, b_at, head_pool, pooled,
                                                   b.roles)
                                   for m in u.members], dim=1)
                if out_store is None:
                    dtype = torch.float64 if feats.dtype == torch.float64 else torch.float32
                    out_store = empty_collection(units, n, dtype, dev)
                F, j = out_store.slots[i]
                out_store.buckets[F][j, rows] = feats.to(out_store.buckets[F].dtype).to(dev)
            if metric_out is not None:
                assert b.answers is not None and b.wrong_answers is not None
                logits = at_positions(out.logits, b.last)
                with metric_where(f"probing batch of examples {', '.join(map(str, b.index[:6]))}"
                                  f"{' ...' if len(b.index) > 6 else ''}"):
                    vals = metric(logits, b.answers.to(logits.device), b.wrong_answers.to(logits.device), None)
                metric_out[local] = vals.detach().double().cpu()
    assert out_store is not None, "collect got no batches"
    out_store.metric = metric_out
    return out_store


@dataclass
class CollectionSetup:
    """Everything a collection needs, validated (no model run)."""

    td: TokenizedData
    siteset: SiteSet
    units: list[UnitRead]
    pooling: Pooling
    pool: PoolFn
    at: Tensor | None  # [N] per-prompt positions of a keyed pooling
    head_pooling: str
    notes: list[str]


def setup_collection(model: ModelAdapter, data: Dataset, sites: Sites, pooling: Pooling | str | None,
                     head_pooling: str, *, prepend_bos: bool = True, answers: bool = False,
                     answer_scoring: Any = "first_token") -> CollectionSetup:
    """Tokenise, resolve the sites and the pooling, and check every per-prompt position."""
    td = tokenize_data(model, data, prepend_bos=prepend_bos, answers=answers, answer_scoring=answer_scoring)
    siteset = sites.resolve(model, td.lengths, td.roles)
    units = unit_reads(model, siteset, head_pooling)
    has_pos_axis = "pos" in siteset.over or any(m.pos is not None for u in units for m in u.members)
    notes = [siteset.note] if siteset.note else []
    if pooling is not None and has_pos_axis:
        raise ConfigError("the sites have a position axis, so each row reads its own position: a pooling over "
                          "positions has nothing to pool", code="pooling_and_position_axis",
                          remedy="drop `pooling`, or drop position from sites.over (then positions are pooled)")
    pool_cfg = Pooling.model_validate(pooling if pooling is not None else "last")
    pool = pool_cfg.function()
    at = pool_cfg.positions(td.prompts, [e.meta for e in data], model.vocab_strings(), model.bos_token_id) \
        if not has_pos_axis else None
    if not has_pos_axis:
        notes.append(f"positions pooled: {pool_cfg.type}" + (f" (meta.{pool_cfg.key})" if pool_cfg.key else "")
                     + (" (a leading BOS left out)" if pool_cfg.leaves_bos_out() else "")
                     + (" (a leading BOS counted)" if pool_cfg.bos_in_mean else ""))
    if any(m.has_heads and m.head is None for u in units for m in u.members):
        notes.append(f"heads pooled: {head_pooling}")
    return CollectionSetup(td, siteset, units, pool_cfg, pool, at, head_pooling, notes)


def bytes_per_example(model: ModelAdapter, reads: list[ActName], T: int) -> int:
    """Activations read plus the logits, per prompt of T tokens."""
    total = 0
    for r in reads:
        sizes = model.axis_sizes(r, T)  # the name in full: a features activation's width is its dictionary's
        count = 1
        for v in sizes.values():
            count *= v
        total += count
    return (total + T * model.structure.d_vocab) * FLOAT


def collect_activations(model: Any, data: Any, sites: Sites | dict, pooling: Pooling | str | dict | None = None,
                        head_pooling: str = "concat", *, batch_size: int = 32, prepend_bos: bool = True,
                        quiet: bool = True) -> Collected:
    """Features of every prompt at every unit of `sites` (pooling defaults to "last" without a
    position axis). `Collected.stacked()` is [S, N, F] ready for `fit_probes`; `.labels` names the rows."""
    from ..data.loading import load_data

    a = adapt(model)
    ds = load_data(data, tokenizer=a.tokenizer)
    sites = sites if isinstance(sites, Sites) else Sites(**sites)
    pool = pooling if pooling is None or isinstance(pooling, Pooling) else Pooling.model_validate(pooling)
    cs = setup_collection(a, ds, sites, pool, head_pooling, prepend_bos=prepend_bos)
    batches = make_batches(cs.td, batch_size, pad_id(a))
    return collect(a, batches, cs.units, cs.pool, cs.at, cs.head_pooling, len(cs.td), quiet=quiet)
