"""Runs that start part-way through the model, and the two attention taps patching needs.

A patch at layer L leaves every earlier layer unchanged, and under causal attention a patch at
position p leaves every earlier position unchanged. A patched run then only computes blocks L.. at
positions p.., from the unpatched run's residual stream entering block L, the new positions
attending to the unchanged ones through a frozen key/value prefix; its logits are read at the
answer positions only (final norm and unembedding on those rows).

- HookedTransformer: its blocks called in order (what its forward does with `start_at_layer`) with a
  frozen TransformerLens key/value cache entry each. The cache holds
  what the attention's k and v hooks return (before rotary, which the attention applies to the whole
  key axis each run), which is what TransformerLens caches for the architectures in tl_backend._KV_AS_HOOKED;
  others (query/key norms, clipped qkv, attention sinks, log-n scaling) start at a layer only.
- TransformerBridge: its blocks L.. called one by one (`bridge_start`), the prefix being what each
  block's attention caches, recorded once per batch of unpatched runs (`record_past`). Checked once
  per model by a tiny forward; a bridge that fails it runs full forwards (stopped after the last
  block) and `prefix_note` says why.
- nnsight: no start part-way ("none"): every patched run is a full forward, stopped after the last block.

Each backend (tl_backend.py, nnsight_backend.py) holds its own walk; this module is what patching calls.

Rows of one batch may start at different blocks: each joins the run at its own block
(`Start.joins`), so one walk over the blocks serves every layer's rows. `prefix_support(model)` says
which path a model gets.

Rotated queries and keys (`rot_q`, `rot_k`) are not canonical activations; they are read here
only to patch one query head's own copy of a shared key under grouped-query attention. Nor are
`past_k` / `past_v`: what block L's attention caches, by layer (`record_past`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .adapter import Intervention, ModelAdapter
from .backend import BaseIntervention
from .names import ActName, parse_name

PrefixSupport = Literal["positions", "layers", "none"]
TAPS = ("rot_q", "rot_k")  # readable and writable here, by layer: ActName("rot_k", L)


def prefix_support(model: ModelAdapter) -> PrefixSupport:
    """How much of an unchanged prefix a patched run can skip on this model."""
    return model.backend.prefix_support(model.structure)  # type: ignore[return-value]


def prefix_note(model: ModelAdapter) -> str:
    """Why this model's runs cannot skip as much as its family could ("" when nothing was refused)."""
    return model.backend.prefix_note(model.structure)


def start_paths(model: ModelAdapter) -> dict[str, str]:
    """How this model's runs that start at a layer ("layers") or at a layer and position ("positions") are
    made, for the plan's notes."""
    return model.backend.start_paths()


@dataclass
class Start:
    """Where a batch of runs starts: block `layer`, positions `position`.. (0, 0 with tokens: a full run).

    Runs may start at later blocks too: `joins[l]` are the rows that enter at block l, appended after
    the rows already running, so one batch holds runs that start at different layers.

    resid:  [R, T - position, d_model] the residual stream entering block `layer` at those positions.
    joins:  block -> [R_l, T - position, d_model] the residual entering that block, of the rows joining there.
    keys, values: per block from `layer` on, [rows running there, position, n_kv_heads, d_head]: what
            the attention cached at the unchanged positions (`past_k`, `past_v`).
    """

    layer: int
    position: int
    resid: Tensor
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    joins: dict[int, Tensor] = field(default_factory=dict)


def prefix_reads(model: ModelAdapter, layers: Sequence[int], positions: bool) -> list[ActName]:
    """What a base run must read so that runs can start at any of `layers` (and positions).
    With positions, `record_past` then adds what the attention caches."""
    reads = {ActName("resid_pre", L) for L in layers}
    if positions and layers:
        reads |= model.backend.prefix_reads(layers, model.structure)
    return sorted(reads)


def record_past(model: ModelAdapter, acts: dict[ActName, Tensor], layer: int) -> None:
    """Add to a base run's activations what each block from `layer` on caches (`past_k.L`, `past_v.L`,
    [B, T, n_kv_heads, d_head]), given its `prefix_reads` with positions."""
    model.backend.record_past(acts, layer, model.structure)


def slice_start(cache: dict[ActName, Tensor], rows: Tensor, layer: int | Tensor, position: int,
                n_layers: int) -> Start:
    """The Start of runs of `rows` (indices into the cached base runs) at position `position`, from block
    `layer`: one layer, or per row [R] (sorted: rows starting at later blocks join there)."""
    row_layer = layer.to(rows.device) if isinstance(layer, Tensor) else torch.full_like(rows, layer)
    first = int(row_layer[0])
    assert bool((row_layer[1:] >= row_layer[:-1]).all()), "rows must be sorted by their first layer"
    joins = {}
    for L in torch.unique(row_layer).tolist():
        joins[L] = cache[ActName("resid_pre", L)][rows[row_layer == L], position:]
    resid = joins.pop(first)
    keys, values = [], []
    if position > 0:
        for L in range(first, n_layers):
            running = rows[row_layer <= L]
            keys.append(cache[ActName("past_k", L)][running, :position])
            values.append(cache[ActName("past_v", L)][running, :position])
    return Start(first, position, resid, keys, values, joins)


def _act(name: ActName | str) -> ActName:
    if isinstance(name, ActName):
        return name
    kind, _, layer = str(name).partition(".")
    return ActName(kind, int(layer)) if kind in TAPS else parse_name(name)


def _lower(model: ModelAdapter, interventions: Sequence[Intervention]) -> list[BaseIntervention]:
    out: list[BaseIntervention] = []
    for iv in interventions:
        act = _act(iv.act)
        out += [(act, iv.fn)] if act.kind in TAPS else model.lower([Intervention(model.resolve(act), iv.fn)])
    return out


def has_taps(model: ModelAdapter, layer: int) -> bool:
    """Whether rotated queries/keys can be tapped at `layer` (rotary models)."""
    return model.backend.has_site(ActName("rot_k", layer))


def logits_at(model: ModelAdapter, positions: Tensor, *, tokens: Tensor | None = None, start: Start | None = None,
              interventions: Sequence[Intervention] = (), grad: bool = False, columns: Tensor | None = None) -> Tensor:
    """Logits [R, d_vocab] at `positions` (indices into the run's own position axis) of a batch of runs;
    with `columns` (token ids), only those: [R, len(columns)].

    Either `tokens` [R, T] (a full forward) or `start` (blocks start.layer.. on positions start.position..,
    where `prefix_support` allows it). Interventions may name `rot_q.L` / `rot_k.L`.
    """
    ivs = _lower(model, interventions)
    rows = torch.arange(len(positions), device=model.device)
    with torch.set_grad_enabled(grad):
        if start is None:
            assert tokens is not None
            if any(_act(iv.act).kind in ("final_scale", "logits") for iv in interventions):
                logits, _ = model.backend.run(tokens.to(model.device), [], ivs)
                logits = logits[rows, positions.to(model.device)]
                return logits if columns is None else logits[:, columns.to(logits.device)]
            resid = model.backend.final_residual(tokens.to(model.device), ivs)
        else:
            resid = model.backend.walk(start, ivs, model.structure)
        return unembed_rows(model, resid[rows, positions.to(model.device)], columns)


def unembed_rows(model: ModelAdapter, final: Tensor, columns: Tensor | None = None) -> Tensor:
    """Logits [R, d_vocab] of final residual rows [R, d_model], or [R, len(columns)] (not tl.unembed:
    TransformerLens's copies W_U.T, d_model x d_vocab, on every call)."""
    normed = model.backend.final_norm(final)
    W_U, b_U = model.weights.W_U, model.weights.b_U
    if columns is not None:
        columns = columns.to(W_U.device)
        W_U, b_U = W_U[:, columns], b_U[columns]
    logits = normed @ W_U.to(normed.dtype) + b_U.to(normed.dtype)
    cap = model.backend.logit_softcap
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def read_run(model: ModelAdapter, tokens: Tensor, reads: Sequence[ActName]) -> tuple[Tensor, dict[ActName, Tensor]]:
    """One plain run: (logits [B, T, V], activations). With taps (rot_q/rot_k) every read is an uncached run's."""
    if not any(a.kind in TAPS for a in reads):
        with torch.no_grad():  # ModelAdapter.run derives `result` outside its own no_grad
            out = model.run(tokens, reads)
        return out.logits, dict(out.acts)
    store: dict[ActName, Tensor] = {}
    ivs = [Intervention(a, _recorder(store, a)) for a in reads]
    with torch.no_grad():
        logits, _ = model.backend.run(tokens.to(model.device), [], _lower(model, ivs))
    return logits, store


def _recorder(store: dict[ActName, Tensor], act: ActName) -> Callable[[Tensor], Tensor]:
    def fn(x: Tensor) -> Tensor:
        store[act] = x
        return x
    return fn


def attention_scale(model: ModelAdapter) -> float:
    """The divisor of q.k in attention scores (checked against the scores wherever it is used)."""
    return model.backend.attention_scale(model.structure)
