"""Runs that start part-way through the model, and the two attention taps patching needs.

A patch at layer L leaves every earlier layer unchanged, and under causal attention a patch at
position p leaves every earlier position unchanged. A patched run then only computes blocks L.. at
positions p.., from the unpatched run's residual stream entering block L, the new positions
attending to the unchanged ones through a frozen key/value prefix; its logits are read at the
answer positions only (final norm and unembedding on those rows).

- HookedTransformer: its blocks called in order (what its forward does with `start_at_layer`) with a
  frozen TransformerLens key/value cache entry each. The cache holds
  what the attention's k and v hooks return (before rotary, which the attention applies to the whole
  key axis each run), which is what TransformerLens caches for the architectures in `_KV_AS_HOOKED`;
  others (query/key norms, clipped qkv, attention sinks, log-n scaling) start at a layer only.
- TransformerBridge: its blocks L.. called one by one (`bridge_start`), the prefix being what each
  block's attention caches, recorded once per batch of unpatched runs (`record_past`). Checked once
  per model by a tiny forward; a bridge that fails it runs full forwards (stopped after the last
  block) and `prefix_note` says why.

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
from typing import Any, Literal

import torch
from torch import Tensor

from . import bridge_start
from .adapter import Intervention, ModelAdapter
from .names import ActName, parse_name

PrefixSupport = Literal["positions", "layers", "none"]
TAPS = ("rot_q", "rot_k")  # readable and writable here, by layer: ActName("rot_k", L)
_KV_AS_HOOKED = ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM")  # the families entoscope builds and tests; others start at a layer only


def prefix_support(model: ModelAdapter) -> PrefixSupport:
    """How much of an unchanged prefix a patched run can skip on this model."""
    if model.backend == "bridge":
        return _bridge_support(model).level  # type: ignore[return-value]
    cfg = model.tl.cfg
    if str(getattr(cfg, "positional_embedding_type", "standard")) not in ("standard", "rotary", "alibi"):
        return "none"  # shortformer: positions are re-added at every layer from outside the residual
    if getattr(cfg, "attention_dir", "causal") != "causal":
        return "none"
    quirks = (getattr(cfg, "use_qk_norm", False), getattr(cfg, "clip_qkv", None) is not None,
              getattr(cfg, "use_attention_sinks", False), getattr(cfg, "use_logn_attn", False),
              getattr(cfg, "use_split_qkv_input", False), getattr(cfg, "use_attn_in", False))
    arch = str(getattr(cfg, "original_architecture", ""))
    if any(quirks) or arch not in _KV_AS_HOOKED:
        return "layers"
    return "positions"


def prefix_note(model: ModelAdapter) -> str:
    """Why this model's runs cannot skip as much as its family could ("" when nothing was refused)."""
    return _bridge_support(model).note if model.backend == "bridge" else ""


def _bridge_support(model: ModelAdapter) -> bridge_start.Support:
    s = model.structure
    return bridge_start.support(model.tl, s.architecture, s.d_vocab, s.mode)


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
    if positions and layers and model.backend == "hooked":  # a HookedTransformer caches its k and v hooks' values
        for L in range(min(layers), model.structure.n_layers):
            reads |= {ActName("k", L), ActName("v", L)}
    return sorted(reads)


def record_past(model: ModelAdapter, acts: dict[ActName, Tensor], layer: int) -> None:
    """Add to a base run's activations what each block from `layer` on caches (`past_k.L`, `past_v.L`,
    [B, T, n_kv_heads, d_head]), given its `prefix_reads` with positions."""
    n = model.structure.n_layers
    if model.backend == "hooked":
        for L in range(layer, n):
            acts[ActName("past_k", L)], acts[ActName("past_v", L)] = acts[ActName("k", L)], acts[ActName("v", L)]
        return
    with torch.no_grad():
        keys, values = bridge_start.record(model.tl, model.structure.architecture, acts[ActName("resid_pre", layer)],
                                           layer)
    for L in range(layer, n):  # the attention's [B, heads, T, d_head], seen as [B, T, heads, d_head]
        acts[ActName("past_k", L)], acts[ActName("past_v", L)] = keys[L].transpose(1, 2), values[L].transpose(1, 2)


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


def _tap_hook(act: ActName) -> str:
    return f"blocks.{act.layer}.attn.hook_{act.kind}"


def _act(name: ActName | str) -> ActName:
    if isinstance(name, ActName):
        return name
    kind, _, layer = str(name).partition(".")
    return ActName(kind, int(layer)) if kind in TAPS else parse_name(name)


def _hooks(model: ModelAdapter, interventions: Sequence[Intervention]) -> list[tuple[str, Callable]]:
    canonical, taps = [], []
    for iv in interventions:
        act = _act(iv.act)
        if act.kind in TAPS:
            taps.append((_tap_hook(act), lambda x, hook=None, fn=iv.fn: fn(x)))
        else:
            canonical.append(Intervention(model.resolve(act), iv.fn))
    return model.intervention_hooks(canonical) + taps


def has_taps(model: ModelAdapter, layer: int) -> bool:
    """Whether rotated queries/keys can be tapped at `layer` (rotary models)."""
    return _tap_hook(ActName("rot_k", layer)) in model.tl.hook_dict


def logits_at(model: ModelAdapter, positions: Tensor, *, tokens: Tensor | None = None, start: Start | None = None,
              interventions: Sequence[Intervention] = (), grad: bool = False, columns: Tensor | None = None) -> Tensor:
    """Logits [R, d_vocab] at `positions` (indices into the run's own position axis) of a batch of runs;
    with `columns` (token ids), only those: [R, len(columns)].

    Either `tokens` [R, T] (a full forward) or `start` (blocks start.layer.. on positions start.position..,
    where `prefix_support` allows it). Interventions may name `rot_q.L` / `rot_k.L`.
    """
    hooks = _hooks(model, interventions)
    tl = model.tl
    rows = torch.arange(len(positions), device=model.device)
    last = model.structure.n_layers
    with torch.set_grad_enabled(grad):
        if start is None:
            assert tokens is not None
            if any(_act(iv.act).kind in ("final_scale", "logits") for iv in interventions):
                logits = tl.run_with_hooks(tokens.to(model.device), fwd_hooks=hooks, return_type="logits")
                logits = logits[rows, positions.to(model.device)]
                return logits if columns is None else logits[:, columns.to(logits.device)]
            resid = _final_residual(tl, tokens.to(model.device), hooks, f"blocks.{last - 1}.hook_resid_post")
        elif model.backend == "bridge":
            past = None
            if start.position > 0:
                layers = range(start.layer, last)
                past = bridge_start.FrozenPrefix({L: k.transpose(1, 2) for L, k in zip(layers, start.keys)},
                                                 {L: v.transpose(1, 2) for L, v in zip(layers, start.values)})
            resid = bridge_start.walk(tl, model.structure.architecture, start.resid, start.layer, start.position,
                                      past=past, hooks=hooks, joins=start.joins)
        else:
            resid = _hooked_walk(tl, start, hooks)
        return unembed_rows(model, resid[rows, positions.to(model.device)], columns)


def _hooked_walk(tl: Any, start: Start, hooks: list[tuple[str, Callable]]) -> Tensor:
    """HookedTransformer's blocks start.layer.. in order (what its forward does with start_at_layer), rows
    joining where `start.joins` says, the unchanged positions in a frozen key/value cache entry per block."""
    h = start.resid
    with tl.hooks(fwd_hooks=hooks):
        for i, block in enumerate(tl.blocks[start.layer:]):
            if start.layer + i in start.joins:
                h = torch.cat([h, start.joins[start.layer + i].to(h.dtype)])
            entry = _kv_entry(start.keys[i], start.values[i]) if start.position > 0 else None
            h = block(h, past_kv_cache_entry=entry)
    return h


class _FinalResidual(Exception):
    """Raised by a hook to end a forward once the last block's output is known (as TransformerLens's
    own stop_at_layer does): the final norm and unembedding then run on the answer rows only."""


def _final_residual(tl: Any, tokens: Tensor, hooks: list[tuple[str, Callable]], name: str) -> Tensor:
    kept: dict[str, Tensor] = {}

    def grab(x: Tensor, hook: Any = None) -> None:
        kept["x"] = x
        raise _FinalResidual

    try:
        tl.run_with_hooks(tokens, fwd_hooks=hooks + [(name, grab)], return_type=None)
    except _FinalResidual:
        pass
    return kept["x"]


def unembed_rows(model: ModelAdapter, final: Tensor, columns: Tensor | None = None) -> Tensor:
    """Logits [R, d_vocab] of final residual rows [R, d_model], or [R, len(columns)] (not tl.unembed:
    TransformerLens's copies W_U.T, d_model x d_vocab, on every call)."""
    tl = model.tl
    normed = tl.ln_final(final[:, None])[:, 0]
    W_U, b_U = model.weights.W_U, model.weights.b_U
    if columns is not None:
        columns = columns.to(W_U.device)
        W_U, b_U = W_U[:, columns], b_U[columns]
    logits = normed @ W_U.to(normed.dtype) + b_U.to(normed.dtype)
    cap = float(getattr(tl.cfg, "output_logits_soft_cap", -1.0) or -1.0)
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    return logits


def read_run(model: ModelAdapter, tokens: Tensor, reads: Sequence[ActName]) -> tuple[Tensor, dict[ActName, Tensor]]:
    """One plain run: (logits [B, T, V], activations). With taps (rot_q/rot_k) every read is recorded by hooks."""
    if not any(a.kind in TAPS for a in reads):
        with torch.no_grad():  # ModelAdapter.run derives `result` outside its own no_grad
            out = model.run(tokens, reads)
        return out.logits, dict(out.acts)
    store: dict[ActName, Tensor] = {}
    ivs = [Intervention(a, _recorder(store, a)) for a in reads]
    with torch.no_grad():
        logits = model.tl.run_with_hooks(tokens.to(model.device), fwd_hooks=_hooks(model, ivs), return_type="logits")
    return logits, store


def _recorder(store: dict[ActName, Tensor], act: ActName) -> Callable[[Tensor], Tensor]:
    def fn(x: Tensor) -> Tensor:
        store[act] = x
        return x
    return fn


def attention_scale(model: ModelAdapter) -> float:
    """The divisor of q.k in attention scores (checked against the scores wherever it is used)."""
    scale = float(getattr(model.tl.cfg, "attn_scale", -1.0) or -1.0)
    use = bool(getattr(model.tl.cfg, "use_attn_scale", True))
    if not use:
        return 1.0
    return scale if scale > 0 else model.structure.d_head ** 0.5


def _kv_entry(keys: Tensor, values: Tensor) -> Any:
    try:
        from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry
    except ImportError:  # older releases
        from transformer_lens.past_key_value_caching import (  # type: ignore[no-redef]
            HookedTransformerKeyValueCacheEntry as TransformerLensKeyValueCacheEntry)
    return TransformerLensKeyValueCacheEntry(keys, values, frozen=True)
