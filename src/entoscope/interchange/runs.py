"""The model runs of interchange interventions: reading every cell's activations, intervened runs that score
the classes, and distributed alignment search (DAS).

A cell is one site (an activation at a layer, a head's slice where the site has heads) at one position
rule (a token index or a role: S2, END). An intervened row r writes, at its base's own token for that
rule, one of

    none      h                                       (the base's own run)
    full      h + s (h_src - h)                       (the whole vector: activation patching of that token)
    basis     h + s (h_src - h) B B^T                 (an interchange inside span(B): bases.interchange)
    placebo   h + m |move of the basis row| / |m|,    m = (h_src - h) Q Q^T for a random Q of B's rank
                                                      (bases.placebo: moves exactly as far, elsewhere)

where h_src is the source's activation at the source's own token for the rule. Runs that can start
part-way (models/partial.py: blocks from the cell's layer on, from the base's residual stream entering it,
and where the model allows, only positions from the batch's earliest intervened token on, attending to the
unchanged ones through a frozen key/value prefix) do; the logits are read at each base's last token for the pair's classes only.

DAS (Geiger et al. 2024): B = the orthonormal columns of a torch orthogonal parametrisation of a
[width, r] matrix, trained with Adam on the cross-entropy of the class logits under the interchange
against the high-level model's target (the setting of TransformerLens 4.3's fit_das: Adam, batches of
pairs reshuffled every epoch, seeded initialisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import orthogonal

from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName
from ..models.partial import logits_at, slice_start
from .bases import interchange, placebo

NONE, FULL, BASIS, PLACEBO = 0, 1, 2, 3


@dataclass(frozen=True)
class Cell:
    act: ActName
    head: int | None
    code: int  # position code (sites.resolve_positions)
    position: str  # as written: END, S2, 3
    label: str  # resid_post.1@S2

    @property
    def layer(self) -> int:
        return int(self.act.layer) if self.act.layer is not None else 0


def select(x: Tensor, cell: Cell, pos: Tensor) -> Tensor:
    """[R, width]: each row's activation at its own token (and the cell's head)."""
    rows = torch.arange(len(pos), device=x.device)
    at = x[rows, pos.to(x.device)]
    return at[:, cell.head] if cell.head is not None else at


def edit(cell: Cell, pos: Tensor, source: Tensor, mode: Tensor, basis: Tensor | Callable[[], Tensor],
         random: Tensor | None, strength: float, offset: int = 0) -> Callable[[Tensor], Tensor]:
    """The intervention function of one batched run (see the module docstring): per row r its token pos[r], the
    source's vector source[r], the mode, the basis (a shared [width, r] or per row [R, width, r]; a callable
    is read at run time: the trained parameters), and the placebo's random bases [R, width, r]. The rows are
    the run's rows offset.. offset + R - 1 (other rows, other cells', are left as they are)."""

    def fn(x: Tensor) -> Tensor:
        whole = x
        x = x[offset:offset + len(pos)]
        h = select(x, cell, pos)
        src = source.to(h.device, h.dtype)
        B = basis() if callable(basis) else basis
        moved = interchange(h, src, B.to(h.device), strength)
        new = torch.where((mode == FULL).to(h.device)[:, None], h + strength * (src - h), h)
        new = torch.where((mode == BASIS).to(h.device)[:, None], moved, new)
        if random is not None and bool((mode == PLACEBO).any()):
            shifted = placebo(h, src, moved - h, random.to(h.device))
            new = torch.where((mode == PLACEBO).to(h.device)[:, None], shifted, new)
        rows = torch.arange(len(pos), device=x.device) + offset
        out = whole.clone()
        if cell.head is not None:
            out[rows, pos.to(x.device), cell.head] = new.to(x.dtype)
        else:
            out[rows, pos.to(x.device)] = new.to(x.dtype)
        return out
    return fn


def class_logits(model: ModelAdapter, cell: Cell, tokens: Tensor, lengths: Tensor, classes: Tensor,
                 fn: Callable[[Tensor], Tensor], cache: dict[ActName, Tensor] | None, rows: Tensor,
                 grad: bool = False, first: int = 0, sets: Tensor | None = None) -> Tensor:
    """[R, C] logits of each row's classes (class ids -1: -inf; [R, K] by output set with `sets`: by_set) at its
    base's last token, under `fn` at the cell; with `cache`, a run from the cached residual entering the cell's
    block (rows index it) at positions `first`.. (`fn` then sees those positions only: it must be made with
    positions counted from `first`)."""
    columns, inverse = torch.unique(classes.clamp_min(0), return_inverse=True)
    iv = [Intervention(cell.act, fn)]
    positions = lengths - 1 - first
    if cache is not None:
        start = slice_start(cache, rows.to(model.device), cell.layer, first, model.structure.n_layers)
        logits = logits_at(model, positions, start=start, interventions=iv, grad=grad, columns=columns)
    else:
        logits = logits_at(model, positions, tokens=tokens, interventions=iv, grad=grad, columns=columns)
    picked = logits.gather(1, inverse.to(logits.device))
    return by_set(picked.masked_fill((classes < 0).to(logits.device), float("-inf")), sets)


def by_set(picked: Tensor, sets: Tensor | None) -> Tensor:
    """[R, K] each output set's logit, the log-sum-exp of its classes' logits (so the argmax compares the sets'
    probability mass; causal.py's greater_than), from the classes' [R, C] and each column's set [R, C]; None:
    every column its own set (the logits unchanged)."""
    if sets is None:
        return picked
    mask = sets.to(picked.device)[..., None] == torch.arange(int(sets.max()) + 1, device=picked.device)
    return torch.logsumexp(picked[..., None].masked_fill(~mask, float("-inf")), dim=1)


def grid_logits(model: ModelAdapter, ivs: list[Intervention], tokens: Tensor, last: Tensor, classes: Tensor,
                cache: dict[ActName, Tensor] | None, rows: Tensor, layers: Tensor, first: int,
                grad: bool = False, sets: Tensor | None = None) -> Tensor:
    """[R, C] class logits (ids -1: -inf; [R, K] by output set with `sets`) at positions `last` (counted from
    `first`) of runs under `ivs`: from the
    cache, rows (indices into it, sorted by `layers`) each joining at its own block at positions first..;
    without a cache, full forwards of `tokens` (then first is 0)."""
    columns, inverse = torch.unique(classes.clamp_min(0), return_inverse=True)
    if cache is not None:
        start = slice_start(cache, rows.to(model.device), layers.to(model.device), first, model.structure.n_layers)
        logits = logits_at(model, last, start=start, interventions=ivs, grad=grad, columns=columns)
    else:
        logits = logits_at(model, last, tokens=tokens, interventions=ivs, grad=grad, columns=columns)
    picked = logits.gather(1, inverse.to(logits.device))
    return by_set(picked.masked_fill((classes < 0).to(logits.device), float("-inf")), sets)


@dataclass(frozen=True)
class DasSettings:
    rank: int
    epochs: int
    batch_size: int
    lr: float
    strength: float
    seed: int
    positions: bool  # runs may start at a position (the cache holds the attention's keys and values)
    boundless: bool = False  # boundless DAS: a full rotation and a learned soft boundary (Wu et al. 2023)

    def steps(self, n: int) -> int:
        return -(-n // self.batch_size) * self.epochs


# boundless DAS's boundary temperature (in dimensions), annealed linearly over the steps. Wu et al. 2023 anneal
# 50 -> 0.1 over Alpaca's 4096-wide stream; 10 -> 0.1 here, for narrower sites (on the 64-wide planted model of
# tests/test_interchange.py, 50 leaves the rotation barely trained until the last epochs: 9.6 degrees off
# the planted direction, against 6.0 with 10)
TEMPERATURE = (10.0, 0.1)
BOUNDARY_START = 0.5  # the boundary's first place, a share of the width
BOUNDARY_WEIGHT = 1.0  # the loss's weight on the boundary (its share of the width): smaller subspaces preferred


class Learned(nn.Module):
    """A learned subspace. DAS (Geiger et al. 2024): the [width, r] orthonormal columns of a torch orthogonal
    parametrisation, seeded. Boundless DAS (Wu et al. 2023): a [width, width] rotation R and a boundary b in
    [0, 1] (a share of the width); the interchange acts on the rotated coordinates through the soft mask
    m_i = sigmoid((b width - i) / T), i = 0..width-1, i.e. h' = h + s (h_src - h) R diag(m) R^T (the basis
    R diag(sqrt m), which bases.interchange takes as it is), the temperature T annealed linearly (TEMPERATURE)
    over training, and the loss adds BOUNDARY_WEIGHT * b. The subspace kept is R's first ceil(b width)
    columns (at least 1): the dimension count the training chose."""

    def __init__(self, width: int, cfg: DasSettings, device: torch.device | str) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.rotation = orthogonal(nn.Linear(width if cfg.boundless else cfg.rank, width, bias=False))
        self.boundary = nn.Parameter(torch.tensor(BOUNDARY_START)) if cfg.boundless else None
        self.temperature = TEMPERATURE[0]
        self.width = width
        self.to(device)

    def anneal(self, step: int, total: int) -> None:
        hi, lo = TEMPERATURE
        self.temperature = hi + (lo - hi) * step / max(1, total - 1)

    def basis(self) -> Tensor:
        w = self.rotation.weight
        if self.boundary is None:
            return w
        at = torch.arange(self.width, device=w.device, dtype=w.dtype)
        root = torch.exp(0.5 * nn.functional.logsigmoid((self.boundary.clamp(0.0, 1.0) * self.width - at)
                                                        / self.temperature))  # sqrt(m), its gradient finite
        return w * root[None, :]

    def penalty(self) -> Tensor | float:
        return 0.0 if self.boundary is None else BOUNDARY_WEIGHT * self.boundary.clamp(0.0, 1.0)

    def final(self) -> Tensor:
        with torch.no_grad():
            w = self.rotation.weight.detach().double().cpu()
            if self.boundary is None:
                return w
            keep = max(1, min(self.width, math.ceil(float(self.boundary.clamp(0.0, 1.0)) * self.width)))
            return w[:, :keep].contiguous()


def train_das(model: ModelAdapter, cell: Cell, width: int, tokens: Tensor, lengths: Tensor, pos: Tensor,
              source: Tensor, classes: Tensor, targets: Tensor, cache: dict[ActName, Tensor] | None,
              cfg: DasSettings, sets: Tensor | None = None) -> tuple[Tensor, list[float]]:
    """The DAS basis [width, rank] (float64) of one cell from its training pairs, and the mean loss of each epoch.
    tokens [N, T] (right-padded), pos [N] the base's token, source [N, width] the source's vectors, classes
    [N, C] token ids, targets [N] class indices; cache: the residual entering the cell's block [N, T, d]."""
    gen = torch.Generator().manual_seed(cfg.seed)
    layer = Learned(width, cfg, model.device)
    params = [p for p in layer.parameters() if p.requires_grad]
    total_steps, step = cfg.steps(len(targets)), 0
    opt = torch.optim.Adam(params, lr=cfg.lr)
    frozen = [p.requires_grad for p in model.module.parameters()]
    model.module.requires_grad_(False)
    losses = []
    try:
        for _ in range(cfg.epochs):
            order = torch.randperm(len(targets), generator=gen)
            total = 0.0
            for lo in range(0, len(order), cfg.batch_size):
                rows = order[lo:lo + cfg.batch_size]
                mode = torch.full((len(rows),), BASIS)
                first = int(pos[rows].min()) if cache is not None and cfg.positions else 0
                layer.anneal(step, total_steps)
                step += 1
                fn = edit(cell, pos[rows] - first, source[rows], mode, layer.basis, None, cfg.strength)
                logits = class_logits(model, cell, tokens[rows], lengths[rows], classes[rows], fn, cache, rows,
                                      grad=True, first=first, sets=None if sets is None else sets[rows])
                loss = nn.functional.cross_entropy(logits.float(), targets[rows].to(logits.device))
                grads = torch.autograd.grad(loss + layer.penalty(), params)
                opt.zero_grad()
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
                total += float(loss.detach()) * len(rows)
            losses.append(total / len(order))
    finally:
        for p, flag in zip(model.module.parameters(), frozen):
            p.requires_grad_(flag)
    return layer.final(), losses


def correct(logits: Tensor, targets: Tensor) -> np.ndarray:
    """1.0 where the row's largest class logit is its target's (ties: the first class, as argmax)."""
    return (logits.argmax(-1).cpu() == targets.cpu()).double().numpy()


def train_das_grid(model: ModelAdapter, cells: list[Cell], width: int, tokens: Tensor, lengths: Tensor,
                   positions: list[Tensor], sources: list[Tensor], classes: Tensor, targets: Tensor,
                   cache: dict[ActName, Tensor] | None, cfg: DasSettings,
                   sets: Tensor | None = None) -> list[tuple[Tensor, list[float]]]:
    """train_das for every cell, the cells of one position rule trained together: each step one run whose rows
    are the batch once per cell, each cell's rows joining at its own block (models/partial.py), each with its
    own basis and Adam; the loss is the sum of the cells' losses, so each basis gets its own cell's gradient
    and the result is the cells' separate training (the same seed, order and steps), in fewer runs."""
    out: dict[int, tuple[Tensor, list[float]]] = {}
    if cache is None:
        for k, cell in enumerate(cells):
            out[k] = train_das(model, cell, width, tokens, lengths, positions[k], sources[k], classes, targets,
                               None, cfg, sets)
        return [out[k] for k in range(len(cells))]
    groups: dict[int, list[int]] = {}
    for k, cell in enumerate(cells):
        groups.setdefault(cell.code, []).append(k)
    frozen = [p.requires_grad for p in model.module.parameters()]
    model.module.requires_grad_(False)
    try:
        for members in groups.values():
            members = sorted(members, key=lambda k: cells[k].layer)
            for k, result in zip(members, _train_group(model, [cells[k] for k in members], width, tokens, lengths,
                                                       positions[members[0]], [sources[k] for k in members],
                                                       classes, targets, cache, cfg, sets)):
                out[k] = result
    finally:
        for p, flag in zip(model.module.parameters(), frozen):
            p.requires_grad_(flag)
    return [out[k] for k in range(len(cells))]


def _train_group(model: ModelAdapter, cells: list[Cell], width: int, tokens: Tensor, lengths: Tensor, pos: Tensor,
                 sources: list[Tensor], classes: Tensor, targets: Tensor, cache: dict[ActName, Tensor],
                 cfg: DasSettings, sets: Tensor | None = None) -> list[tuple[Tensor, list[float]]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    layers, opts = [], []
    total_steps, step = cfg.steps(len(targets)), 0
    for _ in cells:
        layer = Learned(width, cfg, model.device)
        layers.append(layer)
        opts.append(torch.optim.Adam([p for p in layer.parameters() if p.requires_grad], lr=cfg.lr))
    params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    losses: list[list[float]] = [[] for _ in cells]
    G = len(cells)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(targets), generator=gen)
        totals = [0.0] * G
        for lo in range(0, len(order), cfg.batch_size):
            rows = order[lo:lo + cfg.batch_size]
            R = len(rows)
            first = int(pos[rows].min()) if cfg.positions else 0
            mode = torch.full((R,), BASIS)
            for layer in layers:
                layer.anneal(step, total_steps)
            step += 1
            ivs = [Intervention(c.act, edit(c, pos[rows] - first, sources[i][rows], mode, layers[i].basis, None,
                                            cfg.strength, offset=i * R))
                   for i, c in enumerate(cells)]
            stacked = rows.repeat(G).to(model.device)
            row_layers = torch.tensor([c.layer for c in cells]).repeat_interleave(R).to(model.device)
            start = slice_start(cache, stacked, row_layers, first, model.structure.n_layers)
            columns, inverse = torch.unique(classes[rows].clamp_min(0), return_inverse=True)
            logits = logits_at(model, (lengths[rows] - 1 - first).repeat(G), start=start, interventions=ivs,
                               grad=True, columns=columns)
            picked = logits.gather(1, inverse.repeat(G, 1).to(logits.device))
            picked = picked.masked_fill((classes[rows] < 0).repeat(G, 1).to(logits.device), float("-inf"))
            picked = by_set(picked, None if sets is None else sets[rows].repeat(G, 1))
            parts = [nn.functional.cross_entropy(picked[i * R:(i + 1) * R].float(), targets[rows].to(logits.device))
                     for i in range(G)]
            flat = [p for ps in params for p in ps]
            grads = torch.autograd.grad(sum(parts) + sum(layer.penalty() for layer in layers), flat)
            at = 0
            for i in range(G):
                opts[i].zero_grad()
                for p in params[i]:
                    p.grad = grads[at]
                    at += 1
                opts[i].step()
                totals[i] += float(parts[i].detach()) * R
        for i in range(G):
            losses[i].append(totals[i] / len(order))
    return [(layer.final(), losses[i]) for i, layer in enumerate(layers)]
