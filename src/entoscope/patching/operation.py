"""The patching operation: activation patching over a dataset, exact or from gradients.

Conventions (docs/patching.md has them all, with the papers):
- denoising runs the corrupt (counterfactual) prompt and patches in values from the clean prompt;
  noising runs the clean prompt and patches in values from the corrupt one. "base" is the run
  being patched, "source" the other run of the pair. Answers are the clean prompt's.
- the metric is read at the answer position (the last token) of EVERY prompt, per prompt; the
  table averages over the dataset and per_prompt keeps every value.
- comparisons (compare.py): absolute m_patched; difference m_patched - m_base; normalised
  (m_patched - m_base) / (m_source - m_base), NaN and flagged for a pair whose two metrics are equal.
- attribution and integrated gradients estimate m_patched - m_base (attribution.py: sign, rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from ..data.examples import Dataset
from ..data.tokenized import length_batches, pad_id, tokenize_data
from ..errors import ConfigError, DataError, SiteError
from ..executors.columns import PromptColumns
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt, batch_cap
from ..memory import largest
from ..metrics import ANSWER_LOGITS_ONLY, Metric, check_metric_runs, metric_where
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..models.partial import has_taps, prefix_note, prefix_reads, prefix_support, start_paths
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.lazy import LazyDict, LazyTable
from ..results.result import Result
from ..sites import Sites, SiteSet, resolve_positions
from .attribution import attribution_chunk, ig_chunk
from .compare import pair_values, prompt_table, site_table
from .exact import RowBatch, schedule, exact_chunk
from .figures import degenerate_note, patching_figures
from .footprint import patching_footprint
from .references import Pairs, check_alignment, choose_partners, dataset_means, new_chunk, run_base, run_sources
from .slots import SHIFTED_AXES, member_groups, unit_layers, unit_members
from .takeaway import patching_takeaway
from .values import get_patch_value
from .writes import Setup

# Exact patching on a CPU: at most this many token rows (patched rows x positions) per forward. Beyond it the
# block's intermediates leave the cache and each row costs more (SmolLM2-135M, one thread: a block walk of 64
# rows x 15 tokens costs 0.021 s a row, of 256 rows 0.025 s; benchmarks/bench_real_patching.py, docs/speed.md).
CPU_TOKENS = 1024


@dataclass(frozen=True)
class PatchingState:
    """What patching's prepare resolved (every check passed, every batch scheduled)."""

    pairs: Pairs  # token ids of every example by role (base, source), answers, resample partners
    siteset: SiteSet
    setup: Setup  # what is written where (setup.means: the dataset mean, filled per run by the phase context)
    reads: dict[str, list[ActName]]  # run ("base", "source", "mean", ...) -> the activations it reads
    chunks: list[list[int]]  # the examples of each length-grouped chunk (the shards' batches)
    schedules: list[list[RowBatch]]  # exact: each chunk's batches of (example, unit) rows
    rows: int  # rows per patched forward
    pad: int  # the pad token id
    mean_chunk: int  # prompts per forward of the dataset mean (patch: mean)
    past_from: int | None  # the first layer whose cached keys/values part-way runs need


@dataclass(frozen=True)
class MeanContext:
    """The phase context of patch: mean (the driver's global step): the dataset mean of each patched activation."""

    means: dict[ActName, torch.Tensor]


@register_operation
class Patching(Sharded, Operation):
    """Activation patching over a dataset: exact, attribution or integrated gradients.

    method:          "exact" (run the patched model), "attribution" (gradient x activation difference,
                     Nanda 2023) or "integrated_gradients" (ig_steps points along the straight path).
    direction:       "denoising" (run corrupt, patch in clean) or "noising" (run clean, patch in corrupt).
    sites:           what to patch: a Sites grid (layer x position, layer x head, ...), groups patched
                     together, or coordinates.
    metric:          logit_diff, logit, prob, logprob, prob_diff, kl (to the unpatched run), top1, or yours.
    comparison:      the table's `value`: normalized (0 = no effect, 1 = full recovery), difference, absolute.
    aggregate:       normalized over the dataset: "ratio_of_means" ((mean patched - mean base) / (mean source -
                     mean base), robust to a pair with a small gap) or "mean_of_ratios" (of the non-degenerate
                     pairs). The interval, p/q-values and influence columns: `stats` (docs/statistics.md).
    patch:           the value written: source, zero, mean, resample, scaled, noise, or yours (kind "patch").
    patch_params:    options of the patch value (mean: per_position; scaled: factor, of; noise: std).
    source_position: cross-position patching: every unit reads its value at this position of the source
                     run (negative: from its end) instead of at its own position.
    align:           pairs of different token lengths: "none" refuses them; "start"/"end" align positions
                     on the first/last tokens.
    kv_mode:         grouped-query attention: a k/v site picked by query head patches its whole key/value
                     group ("group") or only that query head's own copy ("query_head", exact only).
    ig_steps, ig_rule: integrated gradients: number of points and where they sit (left, right, midpoint).
    prefix_reuse:    start patched runs at the first changed layer (and position): auto, positions, layers, off.
    min_gap:         a pair with |m_source - m_base| <= min_gap has no normalised value.
    per_prompt:      keep the per-prompt table.
    batch_size:      rows (prompt x patch) per patched forward; default from memory.
    """

    name = "patching"
    tests_cells = True  # p, q and significant per row (the plan's screen: operation.screen_plan)
    method: Literal["exact", "attribution", "integrated_gradients"] = Field(default="exact", description="exact: run "
        "each patched model; attribution: gradient x activation difference (Nanda 2023); integrated_gradients: "
        "ig_steps points on the straight path")
    direction: Literal["denoising", "noising"] = Field(default="denoising", description="denoising: run the corrupt "
                                                       "prompt and patch in clean values; noising: run clean, patch "
                                                       "in corrupt")
    sites: Sites = Field(default_factory=lambda: Sites(activation="resid_pre", over=["layer", "position"]),
                         description="what to patch: a Sites grid (layer x position, layer x head, ...), groups "
                         "patched together, or coordinates")
    metric: Metric = Field(default_factory=Metric, description="read at each prompt's answer position: logit_diff, "
                           "logit, prob, logprob, prob_diff, kl (to the unpatched run), top1, or a registered metric")
    comparison: Literal["normalized", "difference", "absolute"] = Field(default="normalized", description="the "
        "table's value: normalized (0 = no effect, 1 = full recovery), difference, or absolute")
    patch: str = Field(default="source", description="the value written: source, zero, mean, resample, scaled, "
                       "noise, or a registered patch value")
    patch_params: dict[str, Any] = Field(default_factory=dict, description="options of the patch value (mean: "
                                         "per_position; scaled: factor, of; noise: std)")
    source_position: int | None = Field(default=None, description="cross-position patching: every unit reads its "
                                        "value at this position of the source run (negative: from its end)")
    align: Literal["none", "start", "end"] = Field(default="none", description="pairs of different token lengths: "
                                                   "none refuses them; start / end align positions on the first / "
                                                   "last tokens")
    kv_mode: Literal["group", "query_head"] = Field(default="group", description="grouped-query attention: a k/v "
                                                    "site picked by query head patches its whole key/value group "
                                                    "(group) or only that head's copy (query_head, exact only)")
    ig_steps: int = Field(default=16, ge=1, le=4096, description="integrated gradients: points along the path from "
                          "the base to the source activation")
    ig_rule: Literal["left", "right", "midpoint"] = Field(default="midpoint", description="integrated gradients: "
        "where each point sits in its step (left, right, midpoint)")
    prefix_reuse: Literal["auto", "positions", "layers", "off"] = Field(default="auto", description="start patched "
        "runs at the first changed layer (and position): auto, positions, layers, or off")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")
    aggregate: Literal["ratio_of_means", "mean_of_ratios"] = Field(default="ratio_of_means", description="normalized "
        "over the dataset: ratio_of_means ((mean patched - mean base) / (mean source - mean base)) or mean_of_ratios "
        "(over the non-degenerate pairs)")
    min_gap: float = Field(default=1e-6, ge=0, description="a pair with |m_source - m_base| <= min_gap has no "
                           "normalised value")
    per_prompt: bool = Field(default=True, description="keep the per-prompt table (result.per_prompt)")

    # ------------------------------------------------------------------ prepare: every check, and the plan
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[PatchingState]:
        assert data is not None
        value = get_patch_value(self.patch)
        params = value.check_params(self.patch_params)
        needs = value.runs(params)
        self._check_data(data, needs)
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos, pairs=data.has_counterfactuals,
                           answers=data.has_answers, answer_scoring=self.answer_scoring,
                           align="refuse" if self.align == "none" else "end")
        metric = self.metric.function()
        self._check_metric(metric, model, td)
        pairs = Pairs.from_data(td, self.direction)
        base_len = pairs.base_lengths()
        siteset = self.sites.resolve(model, base_len.tolist(), pairs.base_roles)
        members = unit_members(siteset, model.structure, self.kv_mode)
        groups = member_groups(members)
        self._check_sites(model, groups, value, params)
        self._check_positions(groups, pairs, needs, params)
        value_names = [ActName("rot_k", g.act.layer) if g.query_head and g.act.kind == "k"
                       and model.structure.positional == "rotary" else g.act for g in groups]
        setup = Setup(model, groups, value_names, len(siteset), unit_layers(members), value, params, needs, metric,
                      self.align, self.source_position, self.seed, self._path(model), pairs.source is not None,
                      answer_logits_only=self.metric.type in ANSWER_LOGITS_ONLY)
        setup.unit_labels = [u.label for u in siteset.units]
        reads = self._reads(model, setup)
        lengths = [max(len(b), len(s)) for b, s in zip(pairs.base, pairs.source_role)]
        T = max(lengths)
        past_from = self._past_from(setup)
        peak = patching_footprint(model, reads, T, past_from, self.method, setup.path,
                                  sorted({g.act for g in setup.groups}))
        budget = self.budget_bytes
        # the chunk's prompts take at most half the budget, the patched rows the rest (memory.py)
        chunk_size = batch_cap(largest(lambda c: peak(c, 1), budget // 2, min(len(td), 64)), len(td))
        if self.method == "attribution" and self.batch_size is not None:
            chunk_size = min(len(td), self.batch_size)
        chunks = length_batches(lengths, chunk_size)
        rows = self._row_batch(model, T, lambda r: peak(max(len(c) for c in chunks), r))
        shared = pairs.shared_prefix(self.align) if value.copies_source and self.source_position is None else None
        schedules = [schedule(setup, base_len[idx], rows, pairs.base_role_rows(idx),
                              None if shared is None else shared[idx]) for idx in chunks] \
            if self.method == "exact" else []
        plan = self._plan(model, td, siteset, setup, chunks, schedules, rows, peak, T)
        state = PatchingState(pairs, siteset, setup, reads, chunks, schedules, rows, pad_id(model), chunk_size,
                              past_from)
        return Prepared(model, data, plan, state)

    def _check_metric(self, metric: Any, model: ModelAdapter, td: Any) -> None:
        check_metric_runs(metric, model, td)
        zero_gradient = {"kl": "kl is zero with zero gradient at the base run (its minimum)",
                         "top1": "top1 is piecewise constant: its gradient is zero almost everywhere"}
        refused = ("kl", "top1") if self.method == "attribution" else ("top1",) if self.method != "exact" else ()
        if self.metric.type in refused:
            raise ConfigError(f"{self.method} of {self.metric.type} estimates nothing: "
                              f"{zero_gradient[self.metric.type]}", code="metric_without_gradient",
                              remedy="use method: exact with this metric, or a smooth metric (logit_diff, logprob, "
                              "prob, prob_diff)")

    def _check_positions(self, groups: list, pairs: Pairs, needs: frozenset[str], params: dict[str, Any]) -> None:
        """Every patched position has a position to read in its source run (pairs, partners, means)."""
        base_len = pairs.base_lengths()
        if self.source_position is not None:
            _check_source_position(groups)
        if "source" in needs:
            check_alignment(groups, base_len, pairs.source_lengths(), self.align, self.source_position, "pair",
                            pairs.base_role_rows(list(range(len(base_len)))))
        if "resample" in needs:
            pairs.partner = choose_partners(pairs, self.seed, same_length=self.align == "none")
            partner_len = pairs.source_lengths()[torch.tensor(pairs.partner)]
            check_alignment(groups, base_len, partner_len, self.align, self.source_position,
                            "resample partner of example", pairs.base_role_rows(list(range(len(base_len)))))
        if "mean" in needs and params.get("per_position", True) and \
                int(base_len.max()) > int(pairs.source_lengths().max()):
            raise ConfigError("some base prompts are longer than every source-role prompt: the mean at their last "
                              "positions would average nothing", code="mean_positions_missing",
                              remedy="patch_params: {per_position: false}, or data whose runs have equal lengths")

    def _check_data(self, data: Dataset, needs: frozenset[str]) -> None:
        if data.has_counterfactuals:
            return
        why = [w for w, on in (("patch: source takes values from the other run of each pair", "source" in needs),
                               ("comparison: normalized divides by the gap between the two runs",
                                self.comparison == "normalized"),
                               ("direction: denoising runs the corrupt prompt", self.direction == "denoising")) if on]
        if why:
            raise DataError(f"this patching config needs counterfactual prompts ({'; '.join(why)}), and "
                            f"{data.name!r} has none", code="data_no_counterfactuals",
                            remedy="use a task with counterfactuals (ioi, induction, facts, greater_than), or, to "
                            "ablate plain prompts: direction: noising, comparison: difference, patch: zero/mean/"
                            "resample/noise/scaled")

    def _check_sites(self, model: ModelAdapter, groups: list, value: Any, params: dict[str, Any]) -> None:
        query_head = any(g.query_head for g in groups)
        for g in groups:
            if g.act.kind == "logits":
                raise SiteError("logits cannot be patched", code="site_not_writable",
                                remedy="patch resid_post of the last layer")
            if g.act.kind != "result":
                model.hook_name(g.act)  # refuses what cannot be written on this model
            if g.query_head and g.act.kind == "k" and model.structure.positional == "rotary":
                if not has_taps(model, g.act.layer):
                    raise ConfigError("this model does not expose rotated keys, needed to patch one query head's "
                                      "own key copy", code="query_head_unsupported", remedy="use kv_mode: group")
                if self.source_position is not None or self.align == "end":
                    raise ConfigError("a query head's own key copy under rotary is patched with the source key at "
                                      "the same position (rotary encodes the position)",
                                      code="query_head_cross_position",
                                      remedy="drop source_position / align: end, or use kv_mode: group")
        if query_head and self.method != "exact":
            raise ConfigError(f"kv_mode: query_head is patched exactly only, not with {self.method}",
                              code="query_head_exact_only", remedy="use method: exact, or kv_mode: group")
        if self.method == "integrated_gradients" and value.per_row:
            raise ConfigError(f"patch {value.name!r} draws a different value per prompt and unit, so there is no "
                              "single path to integrate along", code="ig_per_row_patch",
                              remedy="use method: attribution or exact with this patch, or another patch value")
        kinds = {g.act.kind for g in groups}
        if self.patch == "mean" and not params.get("per_position", True) and kinds & {"pattern", "attn_scores"}:
            raise ConfigError("a mean over all positions of an attention pattern has no meaning",
                              code="mean_over_positions_pattern", remedy="keep per_position: true")

    def _path(self, model: ModelAdapter) -> str:
        support = prefix_support(model)
        if self.prefix_reuse == "off" or self.method == "attribution":
            return "none"
        if self.prefix_reuse == "auto":
            return support if self.method == "exact" else ("layers" if support != "none" else "none")
        rank = {"none": 0, "layers": 1, "positions": 2}
        if rank[support] < rank[self.prefix_reuse]:
            why = prefix_note(model)
            raise ConfigError(f"prefix_reuse: {self.prefix_reuse} is not possible on this model (it supports "
                              f"{support!r}{': ' + why if why else ''})", code="prefix_reuse_unsupported",
                              remedy="use prefix_reuse: auto (it takes what this model supports)")
        if self.method == "integrated_gradients":
            return "layers"
        return self.prefix_reuse

    def _reads(self, model: ModelAdapter, setup: Setup) -> dict[str, list[ActName]]:
        names = sorted(set(setup.value_names))
        base: set[ActName] = set()
        layers = self._start_layers(setup)
        if setup.path != "none":
            base |= set(prefix_reads(model, layers, positions=setup.path == "positions"))
        if self.method != "exact":
            base |= {g.act for g in setup.groups}
        if "base" in setup.needs:
            base |= set(names)
        return {"base": sorted(base), "source": names if "source" in setup.needs else [],
                "resample": names if "resample" in setup.needs else [], "mean": names if "mean" in setup.needs else []}

    def _start_layers(self, setup: Setup) -> list[int]:
        """The layers patched runs start at: each unit's first layer (exact), each activation's (IG)."""
        starts = setup.unit_layer.tolist() if self.method == "exact" else [g.act.layer for g in setup.groups]
        return sorted({int(L) for L in starts if L is not None and L >= 0})

    def _past_from(self, setup: Setup) -> int | None:
        """The first layer whose cached keys/values runs starting at a position need (None: no such runs)."""
        layers = self._start_layers(setup)
        return min(layers) if layers and setup.path == "positions" else None

    def _row_batch(self, model: ModelAdapter, T: int, peak: Any) -> int:
        """Rows per patched batch: batch_size if given, else the most (up to 1,024; on the CPU, CPU_TOKENS tokens)
        whose peak(rows) stays within the budget."""
        if self.batch_size is not None:
            return self.batch_size
        most = 1024
        if self.method == "exact" and torch.device(model.device).type == "cpu":
            most = max(1, CPU_TOKENS // T)
        return largest(peak, self.budget_bytes, most)

    def confirm_subset(self, rows: Any) -> Patching:
        """The confirmation run patches only the screen's top rows (their coordinates), when the sites are a
        grid of integer coordinates; otherwise the whole grid again (Operation.confirm_subset)."""
        base = self.model_copy(update={"confirm": None})
        sites = self.sites if isinstance(self.sites, Sites) else None
        if sites is None or sites.groups is not None or sites.dictionary is not None or \
                not all(ax in rows and pd.api.types.is_integer_dtype(rows[ax]) for ax in sites.over):
            return base
        coords = [{ax: int(row[ax]) for ax in sites.over} for _, row in rows.iterrows()]
        return base.model_copy(update={"sites": sites.model_copy(update={"coords": coords})})

    def confirm_plan_rows(self, prepared: Prepared[PatchingState]) -> Any:
        """The plan's stand-in for the k sites the screen will choose: the grid's first k."""
        assert self.confirm is not None
        return prepared.state.siteset.frame().head(self.confirm.k)

    def _plan(self, model: ModelAdapter, td: Any, siteset: Any, setup: Setup, chunks: list[list[int]],
              schedules: list, rows: int, per_example: Any, T: int) -> Plan:
        E, U = len(td), len(siteset)
        references = 1 + int(setup.with_source) + int("resample" in setup.needs)
        mean = E if "mean" in setup.needs else 0
        sizes = [len(c) for c in chunks] * references
        notes = [siteset.note] if siteset.note else []
        notes.append(self._roles_note(setup))
        if self.method == "exact":
            same = sum(len(b) for sch in schedules for b in sch if b.unchanged)
            forward, backward = E * references + mean + E * U - same, 0
            sizes += [len(b) for sch in schedules for b in sch if not b.unchanged]
            notes.append(_path_note(model, setup.path, self.prefix_reuse))
            if same:
                notes.append(f"{same} of {E * U} patched rows write only positions before the first token where "
                             "their pair's prompts differ, where both runs hold the same activations: their "
                             "metric is the base run's, with no run")
        elif self.method == "attribution":
            forward, backward = E * references + mean, E
            notes.append("attribution: per batch of prompts, one forward with gradients, one backward and one "
                         "source forward, whatever the number of sites")
        else:
            acts = len({g.act for g in setup.groups})
            runs = E * self.ig_steps * acts
            forward, backward = E * references + mean + runs, runs
            sizes += [min(rows, len(c) * self.ig_steps - i) for c in chunks for _ in range(acts)  # ig_chunk's batches
                      for i in range(0, len(c) * self.ig_steps, rows)]
            notes.append(f"integrated gradients: {self.ig_steps} points, {self.ig_rule} rule, alpha = "
                         f"{_alpha_text(self.ig_rule)}; {_path_note(model, setup.path, self.prefix_reuse)}")
        if self._past_from(setup) is not None and model.structure.backend == "bridge":
            forward += E  # record_past: each base prompt walks blocks past_from.. once more for their keys and values
            notes.append(f"the bridge's key/value prefix: each base prompt runs blocks {self._past_from(setup)}.. once "
                         "more to record what their attention caches")
        if any(g.query_head for g in setup.groups):
            notes.append("k/v: each query head's own copy is patched (kv_mode query_head)")
        elif {g.act.kind for g in setup.groups} & {"k", "v"} and model.structure.group_size > 1:
            notes.append(f"k/v: grouped-query attention ({model.structure.group_size} query heads per key/value "
                         "head): a k/v site patches the whole key/value group")
        # the footprint at the largest chunk and the largest batch of patched rows the schedule runs
        patched_rows = [len(b) for sch in schedules for b in sch if not b.unchanged] if self.method == "exact" else \
            sizes[len(chunks) * references:] if self.method != "attribution" else []
        peak = per_example(max(len(c) for c in chunks), max(patched_rows, default=1))
        files = ["table.csv", "table.parquet"] + (["per_prompt.csv", "per_prompt.parquet"] if self.per_prompt
                                                   else []) + ["index.html", "manifest.json"]
        return Plan(self.name, rows=U, forward_passes=forward, backward_passes=backward, batch_sizes=sizes,
                    peak_memory_bytes=int(peak), notes=notes, examples=E, files=files)

    def _roles_note(self, setup: Setup) -> str:
        if not setup.with_source:
            return "no counterfactuals: each prompt is the run being patched"
        if self.direction == "denoising":
            return "denoising: the corrupt (counterfactual) prompt runs; values come from the clean prompt"
        return "noising: the clean prompt runs; values come from the corrupt (counterfactual) prompt"

    # ------------------------------------------------------------------ execute (sharded: docs/scale.md)
    def shard_batches(self, prepared: Prepared[PatchingState]) -> list[list[int]]:
        return prepared.state.chunks  # chunks of examples (their batches of rows are scheduled per chunk)

    def before_phase(self, prepared: Prepared[PatchingState], phase: str, merged: dict[str, Any]) -> Any:
        """The mean patch value is a dataset-wide mean: computed once, on the driver, for every shard."""
        model, st = prepared.model, prepared.state
        setup, reads = st.setup, st.reads
        if not reads["mean"]:
            return None
        means = dataset_means(model, st.pairs, reads["mean"], bool(setup.params.get("per_position", True)),
                              st.mean_chunk, st.pad)
        return MeanContext(means)

    def global_step(self, prepared: Prepared[PatchingState]) -> str:
        return "the dataset mean of the patched activations (patch: mean)" if prepared.state.reads["mean"] else ""

    def execute_shard(self, prepared: Prepared[PatchingState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        """Patched, base and source metrics of the examples of some chunks: [n, U], [n], [n]."""
        model, st = prepared.model, prepared.state
        setup = st.setup
        context: MeanContext | None = prepared.contexts.get(phase)
        if context is not None:
            setup.means = context.means
        ticks = sum(self._chunk_ticks(st, ci, setup.groups) for ci in batches)
        bar = iter(progress(range(ticks), total=ticks, desc="patching", quiet=quiet))
        tick = lambda: next(bar, None)  # noqa: E731  (one step per batched patched run)
        parts = []
        for ci in batches:
            idx = st.chunks[ci]
            with metric_where(f"batch {ci + 1} of {len(st.chunks)} (examples {_span(idx)})"):
                parts.append(self._chunk(model, st, setup, st.pairs, st.reads, ci, idx, tick))
        examples = [i for ci in batches for i in st.chunks[ci]]
        patched, m_base, m_source = (torch.cat([p[k] for p in parts]) for k in range(3))
        return PerPrompt(examples, {"patched": patched.numpy(), "m_base": m_base.numpy(),
                                    "m_source": m_source.numpy()})

    def summarise(self, prepared: Prepared[PatchingState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        return self._result(prepared.model, prepared.state, merged["main"])

    def _chunk_ticks(self, st: PatchingState, ci: int, groups: list) -> int:
        """Batched patched runs of one chunk (the progress bar's steps)."""
        if self.method == "exact":
            return len(st.schedules[ci])
        if self.method == "attribution":
            return 1
        return -(-len(st.chunks[ci]) * self.ig_steps // st.rows) * len({g.act for g in groups})

    def _chunk(self, model: ModelAdapter, st: PatchingState, setup: Setup, pairs: Pairs, reads: dict[str, Any],
               ci: int, idx: list[int], tick: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unpatched runs and every patched run of one chunk of examples: ([n, U] patched, [n] base, [n] source)."""
        chunk = new_chunk(pairs, idx, st.pad)
        if self.method == "attribution":
            estimate = attribution_chunk(setup, chunk, pairs, reads, st.pad)
            result = chunk.m_base.double().cpu()[:, None] + estimate
            tick()
        else:
            with torch.no_grad():
                run_base(model, chunk, reads["base"], setup.metric, st.past_from)
                run_sources(model, chunk, pairs, reads, setup.metric, st.pad, with_source=setup.with_source)
            if self.method == "exact":
                result = exact_chunk(setup, chunk, st.schedules[ci], tick)
            else:
                estimate = ig_chunk(setup, chunk, self.ig_steps, self.ig_rule, st.rows, tick)
                result = chunk.m_base.double().cpu()[:, None] + estimate
        return result.double().cpu(), chunk.m_base.double().cpu(), chunk.m_source.double().cpu()

    def _result(self, model: ModelAdapter, st: PatchingState, columns: PromptColumns) -> Result:
        """The table, its intervals and the per-prompt table, read from the merged columns block by block."""
        siteset, pairs = st.siteset, st.pairs
        m_base, m_source = columns["m_base"], columns["m_source"]
        values = pair_values(lambda lo, hi: columns.read(lo, hi, ["patched"])["patched"], len(siteset), m_base,
                             m_source, self.min_gap, self.stats.degenerate_share)
        sites = siteset.frame()
        extra_cols: dict[str, Any] = {"method": self.method}
        if siteset.kind.name in ("k", "v"):
            grouped = model.structure.group_size > 1
            extra_cols["kv_copy"] = "query head's own copy" if (self.kv_mode == "query_head" and grouped) \
                else "key/value head (whole group)" if grouped else "key/value head"
        table, summary = site_table(values, sites, self.comparison, self.aggregate, self.stats, self.seed, extra_cols)
        per_prompt = None
        if self.per_prompt:
            def rows(lo: int, hi: int) -> pd.DataFrame:
                positions, tokens = _patched_tokens(model, siteset, pairs, lo, hi)
                block = {**values.block(lo, hi), "base": values.base[lo:hi], "source": values.source[lo:hi],
                         "degenerate": values.degenerate[lo:hi]}
                return prompt_table(block, sites, np.arange(lo, hi), positions, tokens)
            per_prompt = LazyTable(values.n, rows, rows_per_prompt=len(siteset))
        n_deg = int(values.degenerate.sum())
        vocab = model.vocab_strings()
        label = f"{self.comparison} {self.metric.type}"
        title = _title(self.method, self.direction, self.patch, siteset.kind.name, label)

        extra = LazyDict({"m_base": torch.from_numpy(m_base), "m_source": torch.from_numpy(m_source),
                          "n_degenerate": n_deg, "degenerate": values.degenerate, "value_label": label,
                          "per_prompt_column": {"absolute": "patched_metric"}.get(self.comparison, self.comparison),
                          "first_tokens": [vocab[t] for t in pairs.base[0]], "path": st.setup.path,
                          "partners": pairs.partner, "summary": summary},
                         {"patched": lambda: torch.from_numpy(columns["patched"])})
        result = Result(self.name, table, per_prompt=per_prompt, figures=patching_figures, title=title, extra=extra,
                        takeaway=patching_takeaway)
        if n_deg:  # shown in the page's warnings box, in the glossary's words
            result.page_warnings = [{"code": "degenerate_pairs",
                                     "message": degenerate_note(n_deg, len(pairs.base), self.stats.degenerate_share)}]
        return result


# ---------------------------------------------------------------------- helpers
def _title(method: str, direction: str, patch: str, kind: str, label: str) -> str:
    """What the page shows: the metric when each site is patched, and how."""
    base, source = ("corrupt", "clean") if direction == "denoising" else ("clean", "corrupt")
    how = f"patched from the {source} run" if patch == "source" else f"given its {patch} value"
    return (f"{label.replace('normalized', 'normalised')} when each {kind} site of the {base} run is {how} "
            f"({method.replace('_', ' ')} patching, {direction})")


def _span(idx: list[int]) -> str:
    shown = ", ".join(map(str, sorted(idx)[:6]))
    return shown + (f", ... ({len(idx)} in all)" if len(idx) > 6 else "")


def _check_source_position(groups: list) -> None:
    for g in groups:
        axes = [j for j, a in enumerate(g.axes) if a in SHIFTED_AXES]
        if not axes or g.whole[axes[0]]:
            raise SiteError("source_position needs every patched site at one position (it says where in the "
                            "source run each value is read)", code="source_position_needs_position",
                            remedy="add position to sites.over, or give positions in coordinates")


def _patched_tokens(model: ModelAdapter, siteset: Any, pairs: Pairs, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """[hi - lo, U] absolute position each unit patches in base prompts lo..hi-1, and the token there ('' if none)."""
    vocab = model.vocab_strings()
    E, U = hi - lo, len(siteset)
    unit_pos = np.array([np.nan if (p := (u.get("pos") if u.get("pos") is not None else u.get("query_pos"))) is None
                         else p for u in siteset.units], dtype=float)
    lengths = torch.tensor([len(pairs.base[e]) for e in range(lo, hi)], dtype=torch.long)
    roles = pairs.base_role_rows(list(range(lo, hi)))
    pos = np.full((E, U), np.nan)
    for u in np.flatnonzero(np.isfinite(unit_pos)):  # per unit, vectorised over examples (roles: each its own token)
        pos[:, u] = resolve_positions(torch.full((E,), int(unit_pos[u])), lengths, roles).numpy()
    tokens = np.full((E, U), "", dtype=object)
    if np.isfinite(unit_pos).any():
        cols = np.isfinite(unit_pos)
        for e in range(E):  # one lookup per example, vectorised over units
            ids = np.asarray(pairs.base[lo + e])
            tokens[e, cols] = [vocab[i] for i in ids[pos[e, cols].astype(int)]]
    return pos, tokens


def _path_note(model: ModelAdapter, path: str, asked: str) -> str:
    how = start_paths(model)
    note = {"positions": f"patched runs start at the first changed layer and position ({how['positions']}); "
                         "logits read at the answer positions only",
            "layers": f"patched runs start at the first changed layer ({how['layers']})",
            "none": "every patched run is a full forward"}[path]
    if asked == "off":
        return note + " (prefix_reuse: off)"
    why = prefix_note(model)
    return note + (f" ({why}; the shortcut is refused)" if why else "")


def _alpha_text(rule: str) -> str:
    return {"left": "k/m for k = 0..m-1", "right": "k/m for k = 1..m", "midpoint": "(k + 1/2)/m for k = 0..m-1"}[rule]
