"""The `circuits` operation: edge scores (EAP, EAP-IG, exact patching) or ACDC on the component
graph, a circuit chosen from them, and its faithfulness (curve, CPR, CMD) by edge patching.

Conventions (docs/circuits.md): graph and names in entoscope.circuits.graph; scores in
entoscope.circuits.eap (score = (s_corrupt - s_clean) . d metric / d input(r), summed over
positions, averaged over prompts: negative when patching the edge lowers the metric); edge
patching in entoscope.circuits.edge_patching; selection, faithfulness, CPR, CMD in
entoscope.circuits.faithfulness; ACDC in entoscope.circuits.acdc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field, field_validator
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..errors import ConfigError
from ..executors.columns import PromptColumns
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import Metric
from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED
from ..models.partial import prefix_support
from ..models.split_inputs import check_split_once, refuse_unsplittable
from ..operation import (
    Operation,
    Plan,
    Prepared,
    progress,
    register_operation,
)
from ..results.result import Result
from ..stats import Summary, significance_columns, streamed_mean, summarise
from .acdc import acdc
from .circuit_result import CircuitResult, _figures
from .eap import Rule, edge_scores_per_prompt, gradient_pass_bytes
from .edge_patching import EdgePatcher
from .faithfulness import (
    MIB_FRACTIONS,
    above,
    curve_circuits,
    curve_table,
    faithfulness,
    faithfulness_summary,
    top_n,
)
from .graph import Circuit, ComponentGraph
from .search import SearchOutcome, next_n, search_rows, start_points
from .search import outcome as search_outcome
from .stability import Stability, circuit_stability
from .takeaway import circuit_blank_note, circuit_takeaway

Method = Literal["eap", "eap_ig", "exact", "acdc"]
ROWS_PER_PASS = 32  # EAP-IG: prompts x integration points in one forward/backward pass


@dataclass(frozen=True)
class CircuitChoice:
    """The driver's global step: the circuit chosen from the merged edge scores, its stability, and every
    circuit whose faithfulness is measured (the curve's `n_curve`, then the chosen one, then the stable one).
    With selection "target" the circuit is found later (circuits/search.py): `circuit` is its first guess, the
    top `budget` edges, and the circuits measured are the curve's and then the top n of each of `start` that
    is not on the curve (the budget's point)."""

    scores: PromptColumns  # the merged per-prompt edge scores it was chosen from
    circuit: Circuit
    stability: Stability | None
    circuits: list[Tensor]
    n_curve: int
    start: tuple[int, ...] = ()  # selection "target": the top-n sizes measured after the curve


@dataclass(frozen=True)
class FaithfulnessContext:
    """The faithfulness phase's context: every circuit measured, as kept-edge masks [circuits, senders, receivers]."""

    kept: Tensor


@dataclass
class CircuitsState:
    """What the circuits' prepare resolved, and (filled on the driver, once per run) what is computed from the
    merged edge scores: before the faithfulness phase, and again by summarise."""

    batches: list[Batch]
    graph: ComponentGraph
    metric: Any  # the metric function
    kl: bool  # the metric is kl
    edge_summary: tuple[PromptColumns, Summary] | None = None  # (the scores, every edge's mean and interval)
    choice: CircuitChoice | None = None
    patchers: dict[tuple[int, ...], EdgePatcher] = field(default_factory=dict)  # target search: kept between phases


@register_operation
class Circuits(Sharded, Operation):
    """Circuit discovery: EAP / EAP-IG / exact edge scores or ACDC, with edge-patching faithfulness.

    method:         "eap" (Syed et al. 2023), "eap_ig" (Hanna et al. 2024), "exact" (patch each edge
                    alone: one forward pass per edge per batch) or "acdc" (Conmy et al. 2023).
    metric:         the task metric (logit_diff, prob_diff, logprob, kl, ... or a registered one).
    steps, rule:    EAP-IG's integration: steps and the Riemann rule (left, right, midpoint, trapezoid).
    selection:      "top_n" (n_edges best by |score|; default 5% of the edges), "threshold", or "target": the
                    smallest top-n edge set the search finds whose faithfulness reaches faithfulness_target,
                    with at most max_edges edges (default 5% of the edges), searched along the curve and
                    bisected between its points (search_steps evaluations at most; circuits/search.py), pruned
                    to the edges on a path from the input to the logits; none found is said as such.
    faithfulness:   fractions of edges for the faithfulness curve (MIB's grid by default; [] for none).
    acdc_threshold: ACDC removes an edge whose damage to the metric is below this.
    max_forward_passes: ACDC's budget of batched forward passes.
    stability, stability_share: circuit stability (circuits/stability.py): resample the prompts
                    `stability` times, choose the circuit again on each resample's mean scores, report
                    each edge's inclusion frequency, the mean pairwise Jaccard and the stable circuit
                    (edges kept in >= `stability_share` of resamples) with its own faithfulness.
    Edge scores carry bootstrap intervals over prompts (score_ci_low/high, p/q-values with
    Benjamini-Hochberg over the edges); faithfulness, CPR and CMD too (docs/statistics.md).
    """

    name = "circuits"
    tests_cells = True  # p, q and significant per row (the plan's screen: operation.screen_plan)
    method: Method = Field(default="eap_ig", description="eap | eap_ig | exact | acdc")
    metric: Metric = Field(default_factory=lambda: Metric(type="logit_diff"), description="task metric")
    steps: int = Field(default=5, ge=1, le=1000, description="EAP-IG integration steps")
    rule: Rule = Field(default="left", description="EAP-IG Riemann rule: left | right | midpoint | trapezoid")
    selection: Literal["top_n", "threshold", "target"] = Field(
        default="top_n", description="how the circuit is chosen: top_n | threshold | target (the smallest top-n "
        "edge set reaching faithfulness_target, searched along the curve)")
    n_edges: int | None = Field(default=None, ge=0, description="edges kept by top_n (default: 5% of the edges)")
    threshold: float | None = Field(default=None, description="score threshold for selection=threshold")
    faithfulness_target: float = Field(default=0.8, gt=0, le=1, description="selection=target: the faithfulness "
                                       "the circuit must reach (its point estimate)")
    max_edges: int | None = Field(default=None, ge=1, description="selection=target: the most edges a circuit may "
                                  "keep (default 5% of the edges); none reaching the target is said as such")
    search_steps: int = Field(default=6, ge=0, le=30, description="selection=target: bisection steps between the "
                              "curve's points (one patched evaluation each)")
    absolute: bool = Field(default=True, description="rank and threshold by |score| (ACDC: |change| for task metrics)")
    faithfulness: list[float] = Field(default_factory=lambda: list(MIB_FRACTIONS),
                                      description="fractions of edges of the faithfulness curve")
    acdc_threshold: float = Field(default=0.01, ge=0, description="ACDC: remove an edge whose damage is below this")
    max_forward_passes: int | None = Field(default=None, ge=1, description="ACDC's budget of batched forward passes")
    stability: int = Field(default=0, ge=0, le=10_000, description="bootstrap resamples of the prompts for circuit "
                           "stability (0: none); the per-prompt edge scores are reused")
    stability_share: float = Field(default=0.5, gt=0, le=1, description="the stable circuit keeps the edges found in "
                                   "at least this share of the resamples")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")

    @field_validator("faithfulness")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0 < p <= 1 for p in v) or any(a >= b for a, b in zip(v, v[1:])):
            raise ValueError("fractions must be in (0, 1] and strictly increasing")
        return v

    # ------------------------------------------------------------------ prepare
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[CircuitsState]:
        assert data is not None
        metric_fn = self.metric.function()  # an unknown metric is refused here
        is_kl = self.metric.type == "kl"
        if self.selection == "threshold" and self.threshold is None and self.method != "acdc":
            raise ConfigError("selection 'threshold' needs a threshold", code="threshold_missing",
                              remedy="give threshold: VALUE, or use selection: top_n")
        refuse_unsplittable(model)
        graph = ComponentGraph.from_structure(model.structure)
        if self.stability and self.method == "acdc":
            raise ConfigError("circuit stability resamples per-prompt edge scores, which ACDC does not have",
                              code="stability_needs_scores", remedy="use method eap, eap_ig or exact with stability")
        if self.n_edges is not None and self.n_edges > graph.n_edges:
            raise ConfigError(f"n_edges={self.n_edges} but this model's graph has {graph.n_edges} edges",
                              code="too_many_edges", remedy=f"use n_edges <= {graph.n_edges}")
        if self.selection == "target":
            if self.method == "acdc":
                raise ConfigError("selection 'target' searches top-n edge sets by their scores, which ACDC does not "
                                  "rank", code="target_needs_scores", remedy="use method eap, eap_ig or exact with "
                                  "selection: target, or selection: threshold with ACDC")
            if self.max_edges is not None and self.max_edges > graph.n_edges:
                raise ConfigError(f"max_edges={self.max_edges} but this model's graph has {graph.n_edges} edges",
                                  code="too_many_edges", remedy=f"use max_edges <= {graph.n_edges}")
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, pairs=True,
                           answers=data.has_answers or not is_kl, answer_scoring=self.answer_scoring)
        s = model.structure
        T = max(td.lengths)
        d = s.d_model
        # sender deltas (and their copies), logits, and what a backward pass keeps per layer
        activations = 4 * T * (3 * s.d_vocab + s.n_layers * (20 * d + 4 * s.n_heads * T + 2 * s.d_mlp))
        per_example = 4 * T * graph.n_senders * d * 3 + activations
        if self.method in ("exact", "acdc") or self.faithfulness or self.selection == "target":
            per_example += 4 * T * graph.n_senders * d  # corrupt sender outputs kept for patching
        gradient = gradient_pass_bytes(model, graph.n_senders, T, self.method, self.steps, self.rule,
                                       ROWS_PER_PASS)

        def peak(b: int) -> int:
            return FIXED + max(b * per_example, gradient(b))

        bs = self.choose_batch_size(0, len(td), peak_of=peak)
        batches = make_batches(td, bs, pad_id(model))
        for b in batches:
            if b.answers is None:  # kl needs no answers
                b.answers = b.wrong_answers = torch.full((len(b), 1), -1, dtype=torch.long)
        nb, E = len(batches), len(td)
        check_split_once(model, batches[0].tokens)  # once per model: the senders add up (models/split_inputs.py)
        if self._needs_patcher():
            prefix_support(model)  # once per model: whether patched runs may start part-way (models/partial.py)
        fwd, bwd, notes = self._passes(graph, nb, E, is_kl)
        plan = Plan(self.name, rows=graph.n_edges, forward_passes=fwd, backward_passes=bwd,
                    batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=peak(bs), notes=notes,
                    files=["table.csv", "table.parquet", "index.html", "manifest.json", "circuit.json",
                           "circuit.graphml", "circuit.html", "summary.json"]
                    + (["faithfulness.csv"] if self.faithfulness and self.method != "acdc" else [])
                    + (["search.csv"] if self.selection == "target" else [])
                    + (["acdc_decisions.csv"] if self.method == "acdc" else []))
        return Prepared(model, data, plan, CircuitsState(batches, graph, metric_fn, is_kl))

    def _passes(self, graph: ComponentGraph, nb: int, E: int, is_kl: bool) -> tuple[int, int, list[str]]:
        """Prompt forwards and backwards of a run (Plan's unit: a prompt through the model once), and notes.

        EAP / EAP-IG: each prompt's clean and corrupt runs, then its n_points gradient runs (points stacked
        in one pass) and their backward. An edge patcher (exact, ACDC, faithfulness, stability) runs each
        prompt's corrupt and clean runs once per phase it serves, then one run per circuit evaluated: exact,
        one per edge; faithfulness, the curve's circuits (but a point keeping every edge or none, which is the
        clean or the corrupt run: curve_points_read), the chosen one and the stable one. ACDC: at most
        one run per edge tried (edges into a receiver that no longer matters are dropped without a run)."""
        fwd, bwd, notes = 0, 0, []
        if self.method in ("eap", "eap_ig"):
            n_points = 1 if self.method == "eap" else self.steps + (1 if self.rule == "trapezoid" else 0)
            fwd, bwd = E * (2 + n_points), E * n_points
            if self.method == "eap" and is_kl:
                notes.append("EAP with kl: the gradient of KL(clean || model) is zero on the clean run, so every "
                             "score is 0; use eap_ig")
        if self.method == "exact":
            fwd += E * (2 + graph.n_edges)
            notes.append(f"exact: one forward pass per edge ({graph.n_edges}) per prompt")
        if self.method == "acdc":
            tried = graph.n_edges if self.max_forward_passes is None else min(graph.n_edges,
                                                                              self.max_forward_passes // nb)
            fwd += E * (2 + tried + 1)
            notes.append(f"ACDC: at most {tried} edges tried, one forward pass per prompt each (the forward passes "
                         "are an upper bound: edges into a receiver that no longer matters are dropped without one)")
        elif self.selection == "target":
            run = sum(0 < int(p * graph.n_edges) < graph.n_edges for p in self.faithfulness)  # curve_points_read
            fwd += E * (2 + run + len(self._start(graph)) + self.search_steps)
            notes.append(f"target search: the smallest top-n edge set with faithfulness >= {self.faithfulness_target:g}"
                         f" and at most {self._edge_budget(graph):,} edges, at most {self.search_steps} bisection steps "
                         "between the curve's points (one forward a prompt each; fewer where the curve settles it)")
        elif self._needs_patcher():
            run = sum(0 < int(p * graph.n_edges) < graph.n_edges for p in self.faithfulness)  # curve_points_read
            fwd += E * (2 + run + 1 + int(bool(self.stability)))
        if self.stability:
            notes.append(f"stability: {self.stability} bootstrap resamples of the per-prompt edge scores (no gradient "
                         f"recomputed), the circuit chosen again on each; the stable circuit keeps edges found in >= "
                         f"{self.stability_share:.0%} of them")
        return fwd, bwd, notes

    # ------------------------------------------------------------------ execute (sharded: docs/scale.md)
    # phase "scores": per-prompt edge scores of some batches; on the driver, the circuit is chosen from their
    # mean (and, with stability, from resamples); phase "faithfulness": per-prompt metrics of every circuit
    # needed (the curve's, the chosen one, the stable one) on the batches; summarise: tables and intervals.
    def not_sharded_reason(self) -> str:
        if self.method == "acdc":
            return "ACDC decides edge by edge on the whole dataset, each decision depending on the one before"
        return ""

    def _needs_patcher(self) -> bool:
        return self.method in ("exact", "acdc") or bool(self.faithfulness) or bool(self.stability) or \
            self.selection == "target"

    def phases(self, prepared: Prepared) -> tuple[str, ...]:
        if self.method == "acdc":
            return ("acdc",)
        if self.selection == "target":
            return ("scores", "faithfulness") + tuple(f"search{k}" for k in range(1, self.search_steps + 1))
        return ("scores", "faithfulness") if self._needs_patcher() else ("scores",)

    def _edge_budget(self, graph: ComponentGraph) -> int:
        """selection "target": the most edges a circuit may keep."""
        return self.max_edges if self.max_edges is not None else max(1, round(0.05 * graph.n_edges))

    def _start(self, graph: ComponentGraph) -> tuple[int, ...]:
        """selection "target": the top-n sizes the faithfulness phase measures after the curve (the budget's, where
        the curve has no point there)."""
        curve = [int(p * graph.n_edges) for p in self.faithfulness]
        return tuple(n for n in start_points(curve, self._edge_budget(graph)) if n not in curve)

    def global_step(self, prepared: Prepared) -> str:
        if self.method == "acdc" or not self._needs_patcher():
            return ""
        if self.selection == "target":
            return ("the curve's circuits chosen from the merged edge scores, between scoring and faithfulness; then "
                    "before each search step, the next top-n edge set from the faithfulness read so far")
        return "the circuit chosen from the merged edge scores" + (" (and from their resamples)" if self.stability
                                                                  else "") + ", between scoring and faithfulness"

    def before_phase(self, prepared: Prepared[CircuitsState], phase: str, merged: dict[str, Any]) -> Any:
        if phase == "faithfulness":
            choice = self._choose(prepared, merged["scores"])
            return FaithfulnessContext(torch.stack(choice.circuits))
        if phase.startswith("search"):  # the next point of the target search, or none where it is done
            graph = prepared.state.graph
            n = next_n(dict(self._search_points(prepared, merged)[0]), self.faithfulness_target, self._edge_budget(graph))
            scores = self._choose(prepared, merged["scores"]).circuit.scores
            kept = [top_n(graph, scores, n, self.absolute)] if n is not None else []
            return FaithfulnessContext(torch.stack(kept) if kept else
                                       torch.zeros(0, graph.n_senders, graph.n_receivers, dtype=torch.bool))
        return None

    def _search_points(self, prepared: Prepared[CircuitsState], merged: dict[str, Any]
                       ) -> tuple[list[tuple[int, float]], dict[int, tuple[str, int]]]:
        """selection "target": the points read so far, (n, faithfulness) in the order read (the curve's and the
        start's of at most the budget, then each search step's), and where each point's per-prompt metrics are
        ({n: (phase, column)}). A step's n is recomputed from the points before it, as before_phase chose it."""
        graph = prepared.state.graph
        budget, E = self._edge_budget(graph), graph.n_edges
        f = merged["faithfulness"].read(0, merged["faithfulness"].n, ["full", "empty", "circuits"])
        m_full, m_empty = float(torch.from_numpy(f["full"]).mean()), float(torch.from_numpy(f["empty"]).mean())

        def fidelity(values: Any) -> float:
            return faithfulness(float(torch.from_numpy(np.ascontiguousarray(values)).mean()), m_empty, m_full)
        points, where = [], {}
        for i, n in enumerate([int(p * E) for p in self.faithfulness] + list(self._start(graph))):
            if 1 <= n <= budget and n not in where:
                points.append((n, fidelity(f["circuits"][:, i])))
                where[n] = ("faithfulness", i)
        for k in range(1, self.search_steps + 1):
            phase = f"search{k}"
            n = next_n(dict(points), self.faithfulness_target, budget)
            if phase not in merged or n is None:
                break
            values = merged[phase].read(0, merged[phase].n, ["circuits"])["circuits"][:, 0]
            points.append((n, fidelity(values)))
            where[n] = (phase, 0)
        return points, where

    def execute_shard(self, prepared: Prepared[CircuitsState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        graph = st.graph
        mine = [st.batches[i] for i in batches]
        examples = sorted(i for b in mine for i in b.index)  # the per-prompt helpers return ascending index
        if phase == "acdc":
            raise AssertionError("ACDC is not sharded")
        if phase == "scores":
            patcher = EdgePatcher(model, graph, mine, st.metric) if self.method == "exact" else None
            scores = self._scores(model, graph, mine, st.metric, patcher, quiet)  # [n, S, R]
            order = graph.mask.T.nonzero()  # (receiver, sender) pairs in edges() order
            return PerPrompt(examples, {"scores": scores[:, order[:, 1], order[:, 0]].numpy()})
        context: FaithfulnessContext = prepared.contexts[phase]
        kept = context.kept
        key = tuple(batches)
        if not len(kept):  # the target search is done: nothing left to evaluate (and its patcher is let go)
            st.patchers.pop(key, None)
            return PerPrompt(examples, {"circuits": np.full((len(examples), 1), np.nan)})
        patcher = st.patchers.pop(key, None) or EdgePatcher(model, graph, mine, st.metric)
        if phase != self.phases(prepared)[-1] and len(batches) == len(st.batches):
            # the target search's next steps read the same batches: one shard of every batch keeps its patcher
            # (its clean and corrupt runs) for them; with several shards each rebuilds its own a step, so that no
            # more than one shard's is held at a time
            st.patchers[key] = patcher
        read = curve_points_read(graph, self.faithfulness, len(kept)) if phase == "faithfulness" else \
            (None,) * len(kept)
        items = progress(list(zip(kept, read)), total=len(kept), desc=phase, quiet=quiet)
        values = torch.stack([patcher.full if r == "full" else patcher.empty if r == "empty" else patcher.per_prompt(k)
                              for k, r in items], 1)  # [n, circuits]
        if phase != "faithfulness":
            return PerPrompt(examples, {"circuits": values.numpy()})
        return PerPrompt(examples, {"full": patcher.full.numpy(), "empty": patcher.empty.numpy(),
                                    "circuits": values.numpy()})

    def execute(self, prepared: Prepared[CircuitsState], *, quiet: bool = False) -> Result:
        if self.method != "acdc":
            return super().execute(prepared, quiet=quiet)
        model, st = prepared.model, prepared.state
        patcher = EdgePatcher(model, st.graph, st.batches, st.metric)
        found = acdc(patcher, self.acdc_threshold, kl=st.kl, absolute=self.absolute,
                     max_forward_passes=self.max_forward_passes, quiet=quiet)
        summary = {"method": self.method, "metric": self.metric.type, "n_edges_total": st.graph.n_edges,
                   "acdc_forward_passes": found.forward_passes, "acdc_budget_exhausted": found.budget_exhausted}
        metrics = {"full": patcher.full, "empty": patcher.empty, "circuit": patcher.per_prompt(found.circuit.kept)}
        return self._result(prepared, found.circuit, summary, metrics, decisions=found.decisions)

    def _edge_summary(self, prepared: Prepared[CircuitsState], columns: PromptColumns) -> Summary:
        """Every edge's mean score over prompts with its interval (entoscope.stats), read block by block."""
        st = prepared.state
        if st.edge_summary is None or st.edge_summary[0] is not columns:
            stat = streamed_mean(columns.n, st.graph.n_edges, _scores_reader(columns), skip_nan=False)
            st.edge_summary = (columns, summarise(stat, self.stats, self.seed))
        return st.edge_summary[1]

    def _choose(self, prepared: Prepared[CircuitsState], columns: PromptColumns) -> CircuitChoice:
        """The driver's global step: the merged per-prompt edge scores -> the circuit, stability, and the list of
        circuits whose faithfulness is measured (curve fractions, then the chosen one, then the stable one)."""
        st = prepared.state
        if st.choice is not None and st.choice.scores is columns:
            return st.choice
        graph = st.graph
        order = graph.mask.T.nonzero()  # (receiver, sender) pairs in edges() order
        dtype = torch.from_numpy(columns.read(0, min(1, columns.n), ["scores"])["scores"]).dtype
        scores = torch.zeros(graph.n_senders, graph.n_receivers, dtype=dtype)
        scores[order[:, 1], order[:, 0]] = torch.from_numpy(self._edge_summary(prepared, columns).value).to(dtype)
        if self.selection == "target":  # the circuit is found by the search (summarise); first the curve's points
            circuit = Circuit(graph, scores, top_n(graph, scores, self._edge_budget(graph), self.absolute))
            curve = curve_circuits(graph, circuit.scores, self.faithfulness, self.absolute) if self.faithfulness else []
            start = self._start(graph)
            st.choice = CircuitChoice(columns, circuit, None, curve + [top_n(graph, circuit.scores, n, self.absolute)
                                                                       for n in start], len(curve), start)
            return st.choice
        circuit = Circuit(graph, scores, self._select(graph, scores))
        stability = None
        if self.stability:
            stability = self._stability(graph, columns, circuit.kept, lambda sc: self._select(graph, sc))
        curve = curve_circuits(graph, circuit.scores, self.faithfulness, self.absolute) if self.faithfulness else []
        circuits = curve + [circuit.kept] + ([stability.stable] if stability is not None else [])
        st.choice = CircuitChoice(columns, circuit, stability, circuits, len(curve))
        return st.choice

    def _stability(self, graph: ComponentGraph, columns: PromptColumns, kept: Tensor, select: Any) -> Stability:
        order = graph.mask.T.nonzero()  # (receiver, sender) pairs in edges() order
        cells = order[:, 1] * graph.n_receivers + order[:, 0]
        return circuit_stability(columns.n, _scores_reader(columns), cells, (graph.n_senders, graph.n_receivers),
                                 select, kept, self.stability, self.stability_share, self.seed, graph.mask)

    def summarise(self, prepared: Prepared[CircuitsState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        graph = prepared.state.graph
        columns = merged["scores"]
        choice = self._choose(prepared, columns)
        circuit, stability = choice.circuit, choice.stability
        summary: dict[str, Any] = {"method": self.method, "metric": self.metric.type, "n_edges_total": graph.n_edges}
        extra_cols = self._edge_intervals(self._edge_summary(prepared, columns))
        order = graph.mask.T.nonzero()  # (receiver, sender) pairs in edges() order
        found: SearchOutcome | None = None
        if self.selection == "target":
            prepared.state.patchers.clear()
            points, where = self._search_points(prepared, merged)
            found = search_outcome(points, self.faithfulness_target, self._edge_budget(graph))
            top = top_n(graph, circuit.scores, found.n, self.absolute)
            circuit = circuit.with_kept(top).pruned()  # the same output as the top n: connected, same faithfulness
            if self.stability:
                stability = self._stability(graph, columns, top, lambda sc: top_n(graph, sc, found.n, self.absolute))
            summary.update({"selection": "target", "faithfulness_target": self.faithfulness_target,
                            "max_edges": self._edge_budget(graph), "found": found.found, "n_top": found.n,
                            "search_points": len(points)})
        kept_edges = circuit.kept[order[:, 1], order[:, 0]].numpy().nonzero()[0]  # a kept edge's score counts
        kept_senders = order[kept_edges, 1].numpy()  # for its sender
        read = _scores_reader(columns)

        def per_sender(lo: int, hi: int) -> np.ndarray:
            out = np.zeros((hi - lo, graph.n_senders))
            np.add.at(out.T, kept_senders, np.asarray(read(lo, hi), dtype=np.float64)[:, kept_edges].T)
            return out
        ns = summarise(streamed_mean(columns.n, graph.n_senders, per_sender, skip_nan=False), self.stats, self.seed)
        node_stats = {n: (float(ns.value[i]), float(ns.ci_low[i]), float(ns.ci_high[i]))
                      for i, n in enumerate(graph.senders)}
        metrics = None
        curve = search = None
        if "faithfulness" in merged:
            f = merged["faithfulness"]  # a few metrics per prompt: read whole
            full, empty, values = (torch.from_numpy(f[k]) for k in ("full", "empty", "circuits"))
            k = choice.n_curve
            if self.faithfulness:
                curve, numbers = curve_table(graph, self.faithfulness, choice.circuits[:k],
                                             [values[:, i].contiguous() for i in range(k)],
                                             full, empty, self.stats, self.seed)
                summary.update(numbers)
            if found is not None:  # the search's points after the curve, and the circuit found (or the best read)
                read = {n: torch.from_numpy(np.ascontiguousarray(
                    merged[ph].read(0, merged[ph].n, ["circuits"])["circuits"][:, i])) for n, (ph, i) in where.items()}
                on_curve = {int(p * graph.n_edges) for p in self.faithfulness}
                search = search_rows(graph, circuit.scores, [(n, "budget" if where[n][0] == "faithfulness" else "search")
                                                           for n, _ in points if n not in on_curve],
                                   read, full, empty, self.absolute, self.stats, self.seed)
                metrics = {"full": full, "empty": empty, "circuit": read[found.n]}
            else:
                metrics = {"full": full, "empty": empty, "circuit": values[:, k].contiguous()}
            if stability is not None and found is None:
                metrics["stable"] = values[:, k + 1].contiguous()
        if stability is not None:
            extra_cols["inclusion"] = stability.inclusion[order[:, 1], order[:, 0]].numpy()
            extra_cols["in_stable_circuit"] = stability.stable[order[:, 1], order[:, 0]].numpy()
            summary.update({"stability_resamples": stability.resamples, "stability_share": stability.share,
                            "stability_jaccard": stability.jaccard, "stability_jaccard_to_full": stability.jaccard_to_full,
                            "n_stable": int(stability.stable.sum()),
                            "stability_size_min": int(stability.sizes.min()),
                            "stability_size_max": int(stability.sizes.max())})
        return self._result(prepared, circuit, summary, metrics, curve=curve, extra_cols=extra_cols,
                            node_stats=node_stats, stability=stability, search=search)

    def _result(self, prepared: Prepared, circuit: Circuit, summary: dict[str, Any], metrics: dict[str, Tensor] | None,
                *, curve: Any = None, decisions: Any = None, extra_cols: dict[str, Any] | None = None,
                node_stats: Any = None, stability: Any = None, search: Any = None) -> Result:
        """The result from the circuit and the per-prompt metrics of the full, empty and chosen (stable) circuits."""
        per_prompt = None
        summary["n_kept"] = circuit.n_kept
        summary["n_kept_pruned"] = circuit.pruned().n_kept
        if metrics is not None:
            full, empty, values = metrics["full"], metrics["empty"], metrics["circuit"]
            m_full, m_empty, m_circ = float(full.mean()), float(empty.mean()), float(values.mean())
            f = faithfulness_summary(values, full, empty, self.stats, self.seed)
            summary.update({"m_full": m_full, "m_empty": m_empty, "m_circuit": m_circ,
                            "faithfulness": faithfulness(m_circ, m_empty, m_full),
                            "faithfulness_ci_low": float(f.ci_low[0]), "faithfulness_ci_high": float(f.ci_high[0]),
                            "faithfulness_influence": float(f.influence[0]), "ci_level": self.stats.ci_level})
            per_prompt = pd.DataFrame({"example": range(len(values)), "metric_clean": full.tolist(),
                                       "metric_corrupt": empty.tolist(), "metric_circuit": values.tolist()})
            if "stable" in metrics:
                stable = metrics["stable"]
                fs = faithfulness_summary(stable, full, empty, self.stats, self.seed)
                summary.update({"stable_faithfulness": float(fs.value[0]),
                                "stable_faithfulness_ci_low": float(fs.ci_low[0]),
                                "stable_faithfulness_ci_high": float(fs.ci_high[0])})
                per_prompt["metric_stable_circuit"] = stable.tolist()
        data_name = prepared.data.name if prepared.data is not None else "data"
        title = f"the {self.method} circuit of the {self.metric.type} on {data_name}: its edges and how much it recovers"
        if summary.get("found") is False:
            title = (f"no {self.method} circuit of the {self.metric.type} on {data_name} reaches faithfulness "
                     f"{self.faithfulness_target:g} within {summary['max_edges']:,} edges: the curve and the edges")
        return CircuitResult(self.name, circuit.table(extra_cols or {}), per_prompt=per_prompt, figures=_figures,
                             title=title,
                             extra={"circuit": circuit, "curve": curve, "summary": summary, "decisions": decisions,
                                    "stability": stability, "node_stats": node_stats, "search": search},
                             takeaway=circuit_takeaway, blank_note=circuit_blank_note(self.method))

    def _scores(self, model: ModelAdapter, graph: ComponentGraph, batches: list[Batch], metric: Any,
                patcher: EdgePatcher | None, quiet: bool) -> Tensor:
        """Per-prompt edge scores [n_prompts, n_senders, n_receivers] (dataset order)."""
        if self.method in ("eap", "eap_ig"):
            return edge_scores_per_prompt(model, batches, metric, method=self.method,  # type: ignore[arg-type]
                                          steps=self.steps, rule=self.rule, rows_per_pass=ROWS_PER_PASS, quiet=quiet)
        assert patcher is not None
        return exact_scores_per_prompt(patcher, quiet=quiet)

    def _edge_intervals(self, s: Any) -> dict[str, Any]:
        """Bootstrap interval, p and BH q-value of each edge's mean score (a Summary in edges() order)."""
        cols = {k: v for k, v in s.columns("score").items() if k != "score"}
        cols.update(significance_columns(s, "score", self.stats))
        cols["ci_level"] = self.stats.ci_level
        return cols

    def _select(self, graph: ComponentGraph, scores: Tensor) -> Tensor:
        if self.selection == "threshold":
            assert self.threshold is not None
            return above(graph, scores, self.threshold, self.absolute)
        n = self.n_edges if self.n_edges is not None else max(1, round(0.05 * graph.n_edges))
        return top_n(graph, scores, n, self.absolute)


def curve_points_read(graph: ComponentGraph, fractions: list[float], n_circuits: int) -> tuple[str | None, ...]:
    """Per circuit of the faithfulness phase (the curve's first): "full" for a curve point keeping every edge (its
    metric is the clean run's: nothing is patched), "empty" for one keeping none (every edge patched: the
    corrupt run), else None (a patched run). The plan counts the same."""
    E = graph.n_edges
    curve = tuple("full" if int(p * E) == E else "empty" if int(p * E) == 0 else None for p in fractions)
    return curve + (None,) * (n_circuits - len(curve))


def _scores_reader(columns: PromptColumns) -> Any:
    """read(lo, hi) -> the per-prompt edge scores [rows, n_edges] of prompts lo..hi-1 (edges() order)."""
    return lambda lo, hi: columns.read(lo, hi, ["scores"])["scores"]


def exact_scores(patcher: EdgePatcher, quiet: bool = False) -> Tensor:
    """score(s -> r) = m(every edge kept but s -> r) - m(clean), averaged over prompts."""
    return exact_scores_per_prompt(patcher, quiet).mean(0)


def exact_scores_per_prompt(patcher: EdgePatcher, quiet: bool = False) -> Tensor:
    """Each prompt's m(every edge kept but s -> r) - m(clean): [n_prompts, n_senders, n_receivers]."""
    graph = patcher.graph
    scores = torch.zeros(len(patcher.full), graph.n_senders, graph.n_receivers)
    for s, r in progress(graph.mask.nonzero().tolist(), total=graph.n_edges, desc="exact", quiet=quiet):
        kept = graph.mask.clone()
        kept[s, r] = False
        scores[:, s, r] = patcher.per_prompt(kept) - patcher.full
    return scores
