"""The interchange operation: where a high-level variable lives, by interchange interventions on subspaces.

Life (docs/interchange.md): `prepare` builds the pairs from the task's high-level causal model (causal.py),
tokenises every prompt once, resolves the grid of cells (layers x positions of one activation kind), checks
the classes are single tokens and the bases are known (the labelled ones need each prompt's value), splits
the pairs into training and held-out ones, and plans; no model runs. Sharded phases (docs/scale.md):

    read       one forward per prompt: its vector at every cell (shared by every cell, basis and pair that
               uses the prompt) and the class logits of the pair it is the base of
    -> driver  every cell's bases from the training pairs: the fixed ones from the read vectors, DAS trained
               (runs.train_das; runs that start at the cell's block, from one cached forward per training base)
    eval       each held-out base: one forward caching the residual entering each grid layer, then per cell
               one batched run of every condition (full vector, each basis, each basis's placebo)
    summarise  the interchange-intervention accuracy (IIA) per cell and condition with Wilson intervals over
               the held-out pairs, the DAS subspace's principal angles with the fixed bases, figures, takeaway
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from ..data.examples import Dataset
from ..data.tokenized import TokenizedData, length_batches, pad, pad_id, tokenize_data
from ..errors import ConfigError, DataError, SiteError
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import readable
from ..models import features
from ..models.footprint import FIXED, Footprint, saved_rates
from ..models.adapter import Intervention, ModelAdapter
from ..models.names import ActName
from ..models.partial import prefix_reads, prefix_support, record_past
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.result import Result
from ..sites import position_text, resolve_positions, role_ref
from ..steering.sites import steerable
from . import bases as B
from .causal import Pairs, build_pairs, split
from .runs import (BASIS, FULL, PLACEBO, Cell, DasSettings, by_set, correct, edit, grid_logits, select,
                   train_das_grid)
from .saved import BASES_FILE, SPLIT_FILE, InterchangeResult, split_record
from .summary import interchange_figures, interchange_table, interchange_takeaway

FLOAT = 4
ROWS_PER_FORWARD = 64


@dataclass(frozen=True)
class InterchangeState:
    pairs: Pairs
    td: TokenizedData
    classes: torch.Tensor  # [P, C] token ids
    sets: torch.Tensor | None  # [P, C] each class column's output set (None: each its own; causal.Pairs.sets)
    n_sets: int  # K, the outputs the argmax is over (C where sets is None)
    held: np.ndarray  # [P] held-out pairs
    cells: list[Cell]
    width: int
    conditions: list[tuple[str, int]]  # (basis name, mode) of the eval runs (mode FULL, BASIS, PLACEBO)
    batches: list[list[int]]
    start: bool  # runs start at the cell's block from a cached residual
    positions: bool  # ... and at the batch's earliest intervened position (a frozen key/value prefix)
    pad: int


@dataclass(frozen=True)
class InterchangeContext:
    """The eval phase's context (the driver's global step): every cell's bases, their placebos' random
    bases, and the held-out pairs' source vectors."""

    bases: list[dict[str, np.ndarray]]  # per cell: name -> [width, r]
    placebos: list[dict[str, np.ndarray]]  # per cell: name -> [width, r] random, the basis's rank
    sources: np.ndarray  # [P, cells, width] (NaN outside the held-out pairs)
    losses: list[list[float]]  # per cell, per learned basis (in the order of `bases`): the mean loss per epoch


@register_operation
class Interchange(Sharded, Operation):
    """Interchange interventions on subspaces, and distributed alignment search (DAS), over a grid of sites.

    variable:    the high-level variable (ioi: io, which name is the indirect object; facts: country;
                 greater_than: yy or decade, of the start year; induction: token, the token to copy); your own
                 pairs name theirs.
    activation:  the site kind (resid_pre, resid_mid, resid_post, attn_out, mlp_out, mlp_post, z / result with
                 head, a feature site features@KEY); layers: the grid's layers ("all" or a list).
    positions:   token indices or roles ([S2, END]): each prompt's own token (bases and sources alike).
    bases:       das (learned, rank r), boundless_das (learned, its rank learned too), mean_difference, probe,
                 pca, neurons, random, sae (chosen SAE features' decoder directions).
    rank:        r, the dimension of every basis (a fixed basis has at most what its construction gives).
    strength:    s in h' = h + s (h_src - h) B B^T.
    placebo:     a norm-matched random subspace of the same rank beside every basis but random.
    test_share:  the share of pairs held out (IIA is measured on them; bases are made from the others).
    epochs, das_batch_size, lr: DAS's training (Adam).
    dictionary, features: basis sae, the span of these features' decoder directions (a registered dictionary's
                 name or a folder; the grid's cells at the site it writes).
    """

    name = "interchange"
    variable: str | None = Field(default=None, description="the high-level variable (ioi: io; facts: country; "
                                 "greater_than: yy or decade; induction: token); your own pairs name theirs")
    activation: str = Field(default="resid_post", description="the site kind: resid_pre, resid_mid, resid_post, "
                            "attn_out, mlp_out, mlp_post, z / result (with head), or a feature site features@KEY")
    layers: Literal["all"] | list[int] = Field(default="all", description="the grid's layers: all, or a list")
    positions: list[int | str] = Field(default_factory=lambda: ["END"], description="token indices or roles ([S2, "
                                       "END]): each prompt's own token, in bases and sources alike")
    head: int | None = Field(default=None, description="the head of a z / result site")
    bases: list[str] = Field(default_factory=lambda: ["das", "mean_difference", "probe", "pca", "neurons", "random"],
                             description="the subspaces compared: das, boundless_das, mean_difference, probe, pca, "
                             "neurons, random, sae")
    rank: int = Field(default=1, ge=1, description="r, the dimension of every basis (a fixed basis has at most what "
                      "its construction gives)")
    strength: float = Field(default=1.0, description="s in h' = h + s (h_src - h) B B^T")
    placebo: bool = Field(default=True, description="beside every basis but random, a norm-matched random subspace "
                          "of the same rank")
    test_share: float = Field(default=0.5, gt=0, lt=1, description="the share of pairs held out: IIA is measured on "
                              "them, bases are made from the others")
    epochs: int = Field(default=10, ge=1, description="DAS training: passes over the training pairs")
    das_batch_size: int = Field(default=32, ge=1, description="DAS training: pairs per Adam step")
    lr: float = Field(default=1e-2, gt=0, description="DAS training: Adam's learning rate")
    dictionary: str | None = Field(default=None, description="basis sae: the dictionary (a registered name or a "
                                   "folder) whose decoder directions span it")
    features: list[int] = Field(default_factory=list, description="basis sae: the features whose decoder directions "
                                "span the subspace")

    # ------------------------------------------------------------------ prepare
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[InterchangeState]:
        assert data is not None
        self._check_bases()
        pairs = build_pairs(data, self.variable)
        if set(self.bases) & set(B.LABELLED):
            known = pairs.labels[np.unique(np.concatenate([pairs.base, pairs.source]))]
            if (known < 0).any() or len(set(known.tolist())) < 2:
                raise DataError(f"bases {sorted(set(self.bases) & set(B.LABELLED))} need every prompt's value of the "
                                "variable (two or more values)", code="interchange_labels",
                                remedy="give label (the base's value) and meta.source_label per pair, or use "
                                "bases das, pca, random")
        td = tokenize_data(model, pairs.prompts, prepend_bos=self.prepend_bos)
        try:
            classes = torch.tensor([[model.token_id(t) for t in row] for row in pairs.classes])
        except DataError as e:
            if pairs.sets is None:
                raise
            raise DataError(f"{e.message} (greater_than's interchange reads the 100 two-digit year tokens)",
                            code="multi_token_answer", remedy="on a tokenizer that writes years digit by digit, "
                            "give your own pairs (docs/interchange.md)") from e
        cells, width = self._cells(model, td)
        self._check_rank(cells, width)
        if "sae" in self.bases:
            self._check_sae(model, cells, width)
        held = split(pairs, self.test_share, self.seed)
        conditions: list[tuple[str, int]] = [("full", FULL)]
        for name in self.bases:
            conditions.append((name, BASIS))
        if self.placebo:
            conditions += [(name, PLACEBO) for name in self.bases if name != "random"]
        support = prefix_support(model)
        sets = None if pairs.sets is None else torch.from_numpy(np.asarray(pairs.sets)).long()
        n_sets = classes.shape[1] if sets is None else int(sets.max()) + 1
        state = InterchangeState(pairs, td, classes, sets, n_sets, held, cells, width, conditions, [],
                                 support != "none", support == "positions", pad_id(model))
        peak = self._peak_of(model, state)
        size = self.choose_batch_size(0, len(td), peak_of=peak)
        state = replace(state, batches=length_batches(td.lengths, size))
        return Prepared(model, pairs.prompts, self._plan(model, state, peak(size)), state)

    def _check_bases(self) -> None:
        unknown = [b for b in self.bases if b not in B.KNOWN]
        if unknown or not self.bases or len(set(self.bases)) != len(self.bases):
            raise ConfigError(f"bases {self.bases} {'name unknown ' + str(unknown) if unknown else 'repeat or are empty'}",
                              code="interchange_bases", remedy=f"choose each once among {', '.join(B.KNOWN)}")

    def _check_rank(self, cells: list[Cell], width: int) -> None:
        """A subspace of a `width`-wide vector has at most `width` dimensions: a larger rank is refused (the bases
        that take it would be cut to the width, or fail, and their rows would report a rank that is not there)."""
        takes = [b for b in self.bases if b not in B.OWN_RANK]
        if takes and self.rank > width:
            site = cells[0].label.rsplit("@", 1)[0] if cells else self.activation
            raise ConfigError(f"rank {self.rank} is above the width of the site {site} ({width}): a subspace of a "
                              f"{width}-wide vector has at most {width} dimensions (bases {takes} take the rank)",
                              code="interchange_rank", remedy=f"use rank 1..{width} (rank {width} is the whole "
                              "vector, the `full` row)")

    def _check_sae(self, model: ModelAdapter, cells: list[Cell], width: int) -> None:
        from ..models.dictionaries.catalog import get_dictionary

        if not self.dictionary or not self.features:
            raise ConfigError("basis sae needs a dictionary and the features whose decoder directions span it",
                              code="interchange_sae", remedy="give dictionary: NAME (or a folder) and features: "
                              "[ids]")
        d = get_dictionary(self.dictionary)
        writes = model.resolve(d.hook_out)
        if writes.layer is not None:  # the feature site's own checks: widths, and the space it was trained in
            features.resolve(model, ActName("features", writes.layer, self.dictionary))
        wrong = [c.label for c in cells if c.act != writes or c.head is not None]
        bad = [f for f in self.features if not 0 <= f < d.d_sae]
        if wrong or bad or d.d_out != width or len(set(self.features)) != len(self.features):
            raise ConfigError(f"basis sae: dictionary {self.dictionary!r} writes {writes} ({d.d_sae} features of "
                              f"width {d.d_out}); " + (f"cells {wrong} are elsewhere" if wrong else
                                                       f"features {bad or self.features} are not its own, once each"),
                              code="interchange_sae", remedy=f"use activation {writes.kind} and layers "
                              f"[{writes.layer}] with it, and features 0..{d.d_sae - 1} once each")

    def _cells(self, model: ModelAdapter, td: TokenizedData) -> tuple[list[Cell], int]:
        n_layers = model.structure.n_layers
        layers = list(range(n_layers)) if self.layers == "all" else list(self.layers)
        if not layers:
            raise SiteError("layers is empty", code="empty_selection", remedy="give layers: all, or a list")
        kind, _, key = self.activation.partition("@")
        width = 0
        cells = []
        lengths = torch.tensor(td.lengths)
        roles = None if td.roles is None else td.roles.positions
        for p in self.positions:
            code = int(p) if isinstance(p, int) else role_ref(str(p), td.roles, "positions")
            at = resolve_positions(torch.full_like(lengths, code), lengths, roles)
            bad = ((at < 0) | (at >= lengths)).nonzero().flatten()
            if len(bad):
                raise SiteError(f"position {p!r} is not a token of prompt {int(bad[0])}", code="site_out_of_range",
                                remedy="use positions every prompt has (roles every prompt marks, END, -k)")
            text = position_text(code, td.roles.names if td.roles is not None else ())
            for L in layers:
                if not 0 <= L < n_layers:
                    raise SiteError(f"layer {L} is out of range", code="site_out_of_range",
                                    remedy=f"this model has layers 0..{n_layers - 1}")
                name = f"{kind}.{L}" + (f"@{key}" if key else "")
                act, width = steerable(model, name, self.head)
                if act.layer is None:
                    raise SiteError(f"{act} has no layer", code="steering_site_kind",
                                    remedy="use a per-layer site (resid_post, attn_out, mlp_out, z with head, ...)")
                head = f".h{self.head}" if self.head is not None else ""
                cells.append(Cell(act, self.head, code, text, f"{act}{head}@{text}"))
        return cells, width

    def _plan(self, model: ModelAdapter, st: InterchangeState, peak: int) -> Plan:
        P = len(st.pairs)
        n_train, n_test = int((~st.held).sum()), int(st.held.sum())
        n_cells = len(st.cells)
        das = len(set(self.bases) & set(B.LEARNED))
        steps = -(-n_train // self.das_batch_size) * self.epochs
        cache = (2 if st.positions and model.structure.backend == "bridge" else 1) if st.start else 0
        train = (n_train * cache + self.epochs * n_train * n_cells) * das
        evaluate = n_test * cache + n_test * n_cells * len(st.conditions)
        forward = len(st.td) + train + evaluate
        backward = self.epochs * n_train * n_cells * das
        notes = [f"{P} pairs of variable {st.pairs.variable!r}: {n_train} train the bases, {n_test} held out measure "
                 f"IIA (seed {self.seed})",
                 f"grid: {n_cells} cells ({', '.join(c.label for c in st.cells)}); conditions per cell: "
                 f"{', '.join(n + (' placebo' if m == PLACEBO else '') for n, m in st.conditions)}",
                 f"forwards: {len(st.td)} reads, {train} training ({steps} DAS steps per cell), {evaluate} evaluation"]
        if cache == 2:
            notes.append("the bridge's key/value prefix: each cached base runs the blocks once more (record_past)")
        if not st.start:
            notes.append("this model cannot start part-way: every training and evaluation run is a full forward")
        return Plan(self.name, rows=n_cells * (1 + len(st.conditions)), forward_passes=forward,
                    backward_passes=backward, batch_sizes=[len(b) for b in st.batches], peak_memory_bytes=int(peak),
                    notes=notes, examples=len(st.td), files=["table.csv", "table.parquet", "index.html",
                                                            BASES_FILE, SPLIT_FILE, "manifest.json"])

    def _peak_of(self, model: ModelAdapter, st: InterchangeState) -> Callable[[int], int]:
        """peak(b) above the loaded model for batches of b prompts (memory.py): the largest of the phases'.
        read: a forward of b prompts reading the cells' activations, with logits from the batch's earliest last
        token on (a bridge unembeds the positions from there; models/adapter.py), counted from the shortest
        prompt's; eval: the batch's cache (runs that start part-way) and ROWS_PER_FORWARD intervened rows, whose
        logits are the class columns only; DAS's training (`_training_bytes`), on the driver between them."""
        fp, s = Footprint(model), model.structure
        lengths = st.td.lengths
        T = max(lengths)
        kept = T - min(lengths) + 1
        reads = fp.act(sorted({c.act for c in st.cells}), 1, T)
        das = set(self.bases) & set(B.LEARNED)
        training = self._training_bytes(model, st, int((~st.held).sum())) if das else 0
        cache = 0
        if st.start:
            kv = (s.n_layers - min(c.layer for c in st.cells)) * (2 * s.n_kv_heads * s.d_head + s.d_model) \
                if st.positions else 0
            cache = T * (len({c.layer for c in st.cells}) * s.d_model + kv) * fp.f
        rows = fp.forward(ROWS_PER_FORWARD, T, logit_rows=0)

        def peak(b: int) -> int:
            read = fp.forward(b, T, logit_rows=b * kept) + b * reads
            return FIXED + max(read, b * cache + rows, training)

        return peak

    def _training_bytes(self, model: ModelAdapter, st: InterchangeState, n_train: int) -> int:
        """DAS's peak (runs.train_das_grid): the training bases' cache (runs that start part-way) and one step's
        run with its backward. A step runs R = das_batch_size pairs once per cell of a position rule, each
        cell's rows from its own block on (where runs cannot start part-way, one cell at a time, a full forward
        whose graph still starts at the cell's edit), at positions from the step's earliest cell token on (every
        position where runs cannot start at one), attending to all T; the weights are frozen, so autograd keeps
        what a frozen forward keeps (models/footprint.saved_rates) in the blocks from the cell's on only. The
        largest position rule's step counts (from the earliest token of all the training bases: an upper bound
        of any step's)."""
        fp, s = Footprint(model), model.structure
        L, T = s.n_layers, max(st.td.lengths)
        R = min(self.das_batch_size, max(1, n_train))
        per_token, per_square = saved_rates(s, fp.f, frozen=True)
        per_token, per_square = per_token / L, per_square / L  # a block's
        base = sorted({int(i) for i in st.pairs.base[~st.held]})
        lengths = torch.tensor([st.td.lengths[i] for i in base])
        roles = None if st.td.roles is None else st.td.roles.subset(base)
        groups: dict[int, list[Cell]] = {}
        for k, cell in enumerate(st.cells):
            groups.setdefault(cell.code if st.start else k, []).append(cell)
        step = 0
        for cells in groups.values():
            first = int(self._pos(cells[0], lengths, roles).min()) if st.positions and len(base) else 0
            Tg = T - first
            blocks = sum(L - c.layer for c in cells)  # the graph starts at the cell's edit
            saved = R * blocks * Tg * (per_token + T * per_square)
            step = max(step, int(saved) + 2 * fp.layer(R * len(cells), Tg))
        cache = 0
        if st.start:  # the training bases' residuals entering the cells' blocks, and (positions) the cached keys
            first_layer = min(c.layer for c in st.cells)
            kv = 2 * s.n_kv_heads * s.d_head + s.d_model if st.positions else 0
            cache = len(base) * T * (len({c.layer for c in st.cells}) * s.d_model + (L - first_layer) * kv) * fp.f
        return cache + step

    # ------------------------------------------------------------------ sharded phases
    def shard_batches(self, prepared: Prepared[InterchangeState]) -> list[list[int]]:
        return prepared.state.batches

    def phases(self, prepared: Prepared[InterchangeState]) -> tuple[str, ...]:
        return ("read", "eval")

    def global_step(self, prepared: Prepared[InterchangeState]) -> str:
        return "each cell's bases from the training pairs (DAS trained on the driver) and their placebos"

    def _rows(self, st: InterchangeState, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, lengths = pad([st.td.prompts[i] for i in idx], st.pad)
        roles = None if st.td.roles is None else st.td.roles.subset(idx)
        return tokens, lengths, roles

    def _pos(self, cell: Cell, lengths: torch.Tensor, roles: torch.Tensor | None) -> torch.Tensor:
        return resolve_positions(torch.full_like(lengths, cell.code), lengths, roles)

    def execute_shard(self, prepared: Prepared[InterchangeState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        st, model = prepared.state, prepared.model
        examples = [i for bi in batches for i in st.batches[bi]]
        n, C, K = len(examples), st.n_sets, len(st.cells)
        P = len(st.pairs)
        if phase == "read":
            acts: np.ndarray | None = None  # float32, float64 on a float64 model (its precision kept)
            clean = np.full((n, C), np.nan)
            row = 0
            for bi in progress(batches, desc="interchange: read", quiet=quiet):
                idx = st.batches[bi]
                tokens, lengths, roles = self._rows(st, idx)
                with torch.no_grad():
                    out = model.run(tokens, sorted({c.act for c in st.cells}), logits_at=lengths - 1)
                for k, cell in enumerate(st.cells):
                    v = readable(select(out[cell.act], cell, self._pos(cell, lengths, roles))).cpu().numpy()
                    if acts is None:
                        acts = np.full((n, K, st.width), np.nan, np.float64 if v.dtype == np.float64 else np.float32)
                    acts[row:row + len(idx), k] = v
                for r, i in enumerate(idx):
                    if i < P:
                        picked = out.logits[r, st.classes[i].to(out.logits.device)][None]
                        clean[row + r] = by_set(picked, None if st.sets is None else st.sets[i][None])[0] \
                            .double().cpu().numpy()
                row += len(idx)
            if acts is None:
                acts = np.full((n, K, st.width), np.nan, np.float32)
            return PerPrompt(examples, {"act": acts, "clean": clean})
        ctx: InterchangeContext = prepared.contexts["eval"]
        out_c = np.full((n, K, len(st.conditions)), np.nan)
        row = 0
        for bi in progress(batches, desc="interchange: eval", quiet=quiet):
            idx = st.batches[bi]
            local = [r for r, i in enumerate(idx) if i < P and st.held[i]]
            if local:
                out_c[[row + r for r in local]] = self._eval_batch(model, st, ctx, [idx[r] for r in local])
            row += len(idx)
        return PerPrompt(examples, {"correct": out_c})

    def _eval_batch(self, model: ModelAdapter, st: InterchangeState, ctx: InterchangeContext,
                    idx: list[int]) -> np.ndarray:
        """[n, cells, conditions] 1.0 where the intervened run gives the prediction. Cells of one position rule
        run together where runs start part-way: each cell's rows join at its own block."""
        tokens, lengths, roles = self._rows(st, idx)
        cache = _cache(model, st, tokens) if st.start else None
        n, J = len(idx), len(st.conditions)
        out = np.zeros((n, len(st.cells), J))
        targets = torch.from_numpy(st.pairs.target[idx])
        groups: dict[int, list[int]] = {}
        for k, cell in enumerate(st.cells):
            groups.setdefault(cell.code if cache is not None else k, []).append(k)
        rows = [(i, j) for j in range(J) for i in range(n)]
        for members in groups.values():
            members = sorted(members, key=lambda k: st.cells[k].layer)
            pos = self._pos(st.cells[members[0]], lengths, roles)
            per_cell = max(1, ROWS_PER_FORWARD // len(members))
            for lo in range(0, len(rows), per_cell):
                chunk = rows[lo:lo + per_cell]
                ex = torch.tensor([i for i, _ in chunk])
                first = int(pos[ex].min()) if st.positions else 0
                sets = None if st.sets is None else st.sets[np.array(idx)[ex.repeat(len(members)).numpy()]]
                ivs = [Intervention(st.cells[k].act, self._edit(st, ctx, k, idx, chunk, ex, pos, first, g * len(chunk)))
                       for g, k in enumerate(members)]
                stacked = ex.repeat(len(members))
                with torch.no_grad():
                    logits = grid_logits(model, ivs, tokens[stacked], lengths[stacked] - 1 - first,
                                         st.classes[np.array(idx)[stacked.numpy()]], cache, stacked,
                                         torch.tensor([st.cells[k].layer for k in members]).repeat_interleave(len(chunk)),
                                         first, sets=sets)
                for g, k in enumerate(members):
                    part = logits[g * len(chunk):(g + 1) * len(chunk)]
                    out[ex.numpy(), k, [j for _, j in chunk]] = correct(part, targets[ex])
        return out

    def _edit(self, st: InterchangeState, ctx: InterchangeContext, k: int, idx: list[int], chunk: list[tuple[int, int]],
              ex: torch.Tensor, pos: torch.Tensor, first: int, offset: int) -> Any:
        """Cell k's intervention for the rows of `chunk` ((example, condition) pairs), at rows offset.. of the run."""
        rank = max(b.shape[1] for b in ctx.bases[k].values()) if ctx.bases[k] else 1
        basis = torch.zeros(len(chunk), st.width, rank, dtype=torch.float64)
        random = torch.zeros_like(basis)
        mode = torch.zeros(len(chunk), dtype=torch.long)
        for r, (_, j) in enumerate(chunk):
            name, m = st.conditions[j]
            mode[r] = m
            if m != FULL:
                b = torch.from_numpy(ctx.bases[k][name])
                basis[r, :, :b.shape[1]] = b
                if m == PLACEBO:
                    q = torch.from_numpy(ctx.placebos[k][name])
                    random[r, :, :q.shape[1]] = q
        src = torch.from_numpy(ctx.sources[st.pairs.source[np.array(idx)[ex.numpy()]], k])
        return edit(st.cells[k], pos[ex] - first, src, mode, basis, random, self.strength, offset=offset)

    def before_phase(self, prepared: Prepared[InterchangeState], phase: str, merged: dict[str, Any]) -> Any:
        if phase != "eval":
            return None
        st, model = prepared.state, prepared.model
        acts = torch.from_numpy(merged["read"].read(0, len(st.td), ["act"])["act"]).double()
        pairs = st.pairs
        train = np.flatnonzero(~st.held)
        prompts = np.unique(np.concatenate([pairs.base[train], pairs.source[train]]))
        gen = torch.Generator().manual_seed(self.seed)
        cfg = DasSettings(self.rank, self.epochs, self.das_batch_size, self.lr, self.strength, self.seed, st.positions)
        bases, placebos, losses = [], [], []
        learned = {name: self._das(model, st, train, acts, replace(cfg, boundless=name == "boundless_das"))
                   for name in self.bases if name in B.LEARNED}
        for k, cell in enumerate(st.cells):
            x = acts[:, k]
            labels = torch.from_numpy(pairs.labels[prompts])
            made: dict[str, np.ndarray] = {}
            for name in self.bases:
                if name == "mean_difference":
                    b = B.mean_difference_basis(x[prompts], labels, self.rank)
                elif name == "probe":
                    b = B.probe_basis(x[prompts], labels, self.rank)
                elif name == "neurons":
                    b = B.neuron_basis(x[prompts], labels, self.rank)
                elif name == "pca":
                    b = B.pca_basis(x[pairs.source[train]] - x[pairs.base[train]], self.rank)
                elif name == "sae":
                    from ..models.dictionaries.catalog import get_dictionary

                    b = B.decoder_basis(get_dictionary(str(self.dictionary)).W_dec.detach().double().cpu(),
                                        list(self.features))
                elif name == "random":
                    b = B.random_basis(st.width, self.rank, gen)
                else:
                    b, loss = learned[name][k]
                    losses.append(loss)
                made[name] = b.numpy()
            bases.append(made)
            placebos.append({name: B.random_basis(st.width, max(1, b.shape[1]), gen).numpy()
                             for name, b in made.items() if name != "random"})
        sources = np.full((len(st.td), len(st.cells), st.width), np.nan)
        used = np.unique(pairs.source[st.held])
        sources[used] = acts[used].numpy()
        return InterchangeContext(bases, placebos, sources, losses)

    def _das(self, model: ModelAdapter, st: InterchangeState, train: np.ndarray, acts: torch.Tensor,
             cfg: DasSettings) -> list[tuple[torch.Tensor, list[float]]]:
        """Every cell's DAS basis and losses, from the training pairs (runs.train_das_grid)."""
        pairs = st.pairs
        tokens, lengths, roles = self._rows(st, [int(pairs.base[i]) for i in train])
        cache = _cache(model, st, tokens) if st.start else None
        positions = [self._pos(cell, lengths, roles) for cell in st.cells]
        sources = [acts[pairs.source[train], k] for k in range(len(st.cells))]
        return train_das_grid(model, st.cells, st.width, tokens, lengths, positions, sources, st.classes[train],
                              torch.from_numpy(pairs.target[train]), cache, cfg,
                              None if st.sets is None else st.sets[train])

    # ------------------------------------------------------------------ summarise
    def summarise(self, prepared: Prepared[InterchangeState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        st = prepared.state
        n = len(st.td)
        read = merged["read"].read(0, n, ["clean"])["clean"]
        right = merged["eval"].read(0, n, ["correct"])["correct"]
        ctx: InterchangeContext = prepared.contexts["eval"]
        table = interchange_table(st, read, right, ctx, self.stats.ci_level, self.strength)
        title = f"interchange interventions: variable {st.pairs.variable} at {self.activation}"
        split = split_record(st.pairs.base, st.pairs.source, st.held, self.seed, self.test_share)
        return InterchangeResult(self.name, table, figures=interchange_figures, title=title,
                                 takeaway=interchange_takeaway,
                                 extra={"variable": st.pairs.variable, "losses": ctx.losses, "bases": ctx.bases,
                                        "cells": [c.label for c in st.cells], "split": split})


def _cache(model: ModelAdapter, st: InterchangeState, tokens: torch.Tensor) -> dict[ActName, torch.Tensor]:
    """The residual entering each grid layer's block (and, for runs that start at a position, what each block's
    attention caches), for runs that start there: one read-only forward (the bridge: one more walk)."""
    layers = sorted({c.layer for c in st.cells})
    with torch.no_grad():
        out = model.run(tokens, prefix_reads(model, layers, st.positions), logits=False)
        acts = dict(out.acts)
        if st.positions:
            record_past(model, acts, layers[0])
    return acts
