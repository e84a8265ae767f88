"""Attribution patching and integrated gradients: the effect of a patch from gradients.

Sign convention: an estimate is of m(patched) - m(base), the same quantity exact patching
measures as the "difference" comparison; delta = a_patch - a_base (a_patch: the patch value, e.g.
the source run's activation; a_base: the run being patched).

attribution (Nanda 2023, "Attribution patching"; Syed et al. 2023, "Attribution patching
outperforms automated circuit discovery"): the first-order Taylor term
    effect(unit) ~= sum over the unit's elements of delta . dm/da, gradient taken on the BASE run.
One base forward with gradients, one backward and one source forward per batch of prompts,
whatever the number of sites.

integrated gradients (Sundararajan et al. 2017; for patching, Hanna et al. 2024 / Marks et al.
2024): along the straight path a(alpha) = a_base + alpha delta of ONE activation (one layer's
tensor; every element some unit covers moves, the others stay), average the gradient of m over
`ig_steps` points, then multiply by delta. The points (the integration rule):
    left      alpha = k/m,        k = 0..m-1   (m = 1: exactly attribution, the gradient at the base run)
    right     alpha = k/m,        k = 1..m     (m = 1: the gradient at the fully patched point)
    midpoint  alpha = (k + 1/2)/m, k = 0..m-1  (the default: error O(1/m^2))
Completeness: over all the elements of one activation, the estimates sum to m(a_base + delta) -
m(a_base) up to the Riemann error of the rule. Each activation of the site set is integrated in
its own runs (rows = steps x prompts, batched), starting at its layer where the backend allows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..models.adapter import Intervention
from ..models.names import ActName
from ..metrics import at_positions
from ..models.partial import logits_at, slice_start
from .references import Chunk, Pairs, run_sources, score
from .slots import grid_index, make_slots
from .writes import Setup, answer_columns, score_rows, slot_values

ROWS_PER_BLOCK = 4096  # (example, unit) rows whose slots are gathered at once


def alphas(steps: int, rule: str) -> Tensor:
    k = torch.arange(steps, dtype=torch.float64)
    if rule == "left":
        return k / steps
    if rule == "right":
        return (k + 1) / steps
    return (k + 0.5) / steps


def grad_name(act: ActName) -> ActName:
    """Where the gradient of a patched activation is read: a head's result shares attn_out's gradient."""
    return ActName("attn_out", act.layer) if act.kind == "result" else act


def attribution_chunk(setup: Setup, chunk: Chunk, pairs: Pairs, reads: dict[str, list[ActName]],
                      pad_id: int) -> Tensor:
    """First-order estimate of m(patched) - m(base) for every (example, unit): [C, U] (float64)."""
    model = setup.model
    recorded: dict[ActName, Tensor] = {}
    names = sorted({grad_name(g.act) for g in setup.groups})
    recorders = [Intervention(n, _recorder(recorded, n)) for n in names]
    out = model.run(chunk.base_tokens, reads["base"], interventions=recorders, grad=True)
    at = at_positions(out.logits, chunk.last)
    chunk.reference = at.detach()
    m = score(setup.metric, chunk, at, chunk.reference)
    grads = torch.autograd.grad(m.sum(), [recorded[n] for n in names], allow_unused=True)
    grad = {n: (torch.zeros_like(recorded[n]) if g is None else g).detach() for n, g in zip(names, grads)}
    chunk.m_base = m.detach()
    chunk.acts["base"] = {k: v.detach() for k, v in out.acts.items()}
    del out, recorded, m, at
    run_sources(model, chunk, pairs, reads, setup.metric, pad_id, with_source=setup.with_source)
    return _contract(setup, chunk, lambda act: _expand_grad(grad[grad_name(act)], act, setup))


def _recorder(store: dict[ActName, Tensor], act: ActName) -> Callable[[Tensor], Tensor]:
    def fn(x: Tensor) -> Tensor:
        if not x.requires_grad:  # a model whose parameters are frozen: start the graph here
            x = x.detach().requires_grad_(True)
        store[act] = x
        return x
    return fn


def _expand_grad(g: Tensor, act: ActName, setup: Setup) -> Tensor:
    if act.kind == "result":  # [B, T, d_model] -> [B, T, n_heads, d_model]
        return g[:, :, None, :].expand(-1, -1, setup.model.structure.n_heads, -1)
    return g


def _contract(setup: Setup, chunk: Chunk, gradient: Callable[[ActName], Tensor]) -> Tensor:
    """sum over each unit's elements of (value - base) . gradient, for every (example, unit)."""
    C, U = len(chunk), setup.n_units
    out = torch.zeros(C, U, dtype=torch.float64)
    ex_all = torch.arange(C).repeat_interleave(U)
    unit_all = torch.arange(U).repeat(C)
    sizes = setup.sizes(chunk.base_tokens.shape[1])
    for i in range(0, len(ex_all), ROWS_PER_BLOCK):
        ex, unit = ex_all[i:i + ROWS_PER_BLOCK], unit_all[i:i + ROWS_PER_BLOCK]
        for gi, g in enumerate(setup.groups):
            slots = make_slots(g, ex, unit, chunk.base_len, chunk.base_roles)
            if not len(slots):
                continue
            index = grid_index(slots, slots.ex, sizes)
            delta = slot_values(setup, chunk, slots, gi) - chunk.acts["base"][g.act][index]
            grad = gradient(g.act)[index]
            contrib = (delta.double() * grad.double()).reshape(len(slots), -1).sum(1).cpu()  # slots may be scalars
            out.index_put_((slots.ex, slots.unit), contrib, accumulate=True)
    return out


def ig_chunk(setup: Setup, chunk: Chunk, steps: int, rule: str, max_rows: int,
             tick: Callable[[], None]) -> Tensor:
    """Integrated-gradients estimate of m(patched) - m(base) for every (example, unit): [C, U] (float64).

    Expects the chunk's base and source runs done (base activations of every patched activation,
    and resid_pre of their layers when runs start part-way)."""
    model = setup.model
    C, U = len(chunk), setup.n_units
    T = chunk.base_tokens.shape[1]
    sizes = setup.sizes(T)
    ex_all = torch.arange(C).repeat_interleave(U)
    unit_all = torch.arange(U).repeat(C)
    deltas: dict[ActName, Tensor] = {}
    for gi, g in enumerate(setup.groups):
        slots = make_slots(g, ex_all, unit_all, chunk.base_len, chunk.base_roles)
        if not len(slots):
            continue
        base = chunk.acts["base"][g.act]
        index = grid_index(slots, slots.ex, sizes)
        delta = deltas.setdefault(g.act, torch.zeros_like(base))
        delta[index] = (slot_values(setup, chunk, slots, gi) - base[index]).to(base.dtype)
    alpha = alphas(steps, rule)
    mean_grad: dict[ActName, Tensor] = {}
    for act, delta in deltas.items():
        total = torch.zeros_like(delta, dtype=torch.float64)
        coef_all = alpha.repeat_interleave(C)
        ex_rows = torch.arange(C).repeat(steps)
        for i in range(0, len(ex_rows), max_rows):
            ex, coef = ex_rows[i:i + max_rows], coef_all[i:i + max_rows]
            leaf: dict[str, Tensor] = {}
            iv = Intervention(act, _interpolate(delta, ex, coef, leaf))
            positions = chunk.last[ex]
            columns = answer_columns(setup, chunk, ex)
            if setup.path != "none" and act.layer is not None:
                start = slice_start(chunk.acts["base"], ex.to(model.device), act.layer, 0, model.structure.n_layers)
                logits = logits_at(model, positions, start=start, interventions=[iv], grad=True, columns=columns)
            else:
                logits = logits_at(model, positions, tokens=chunk.base_tokens[ex], interventions=[iv], grad=True,
                                   columns=columns)
            m = score_rows(setup.metric, chunk, ex, logits, columns)
            (g,) = torch.autograd.grad(m.sum(), [leaf["x"]], allow_unused=True)
            if g is not None:
                total.index_add_(0, ex.to(total.device), g.detach().double())
            tick()
        mean_grad[act] = total / steps
    return _contract(setup, chunk, lambda act: mean_grad[act])


def _interpolate(delta: Tensor, ex: Tensor, coef: Tensor, leaf: dict[str, Tensor]) -> Callable[[Tensor], Tensor]:
    def fn(x: Tensor) -> Tensor:
        shape = (len(ex),) + (1,) * (x.dim() - 1)
        d = delta[ex.to(delta.device)].to(x.device, x.dtype)
        moved = x + coef.to(x.device, x.dtype).view(shape) * d
        if not moved.requires_grad:
            moved.requires_grad_(True)
        leaf["x"] = moved
        return moved
    return fn
