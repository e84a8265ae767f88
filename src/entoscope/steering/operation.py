"""The steering operation: push on a direction at a site, and measure what it does, with intervals and side effects.

Life (docs/steering.md): `prepare` resolves and checks the direction (its width against the sites it is
written at, finite and non-zero, coefficients that would overflow), the position rule against every
prompt, and the prompts of the run (rows.py: the task, held-out text, the built-in tasks' prompts, the
direction's own prompts), and plans; no model runs. Sharded phases (docs/scale.md):

    direction   (a mean difference made by the run) each direction prompt's vector at the site
    -> driver   the direction from the merged vectors (or the one the config gives), its random baseline
    steer       each prompt unsteered and under every (direction or random, coefficient) condition:
                metric, KL and loss per prompt (runs.py); continuations of the first prompts (generate.py)
    summarise   the table with bootstrap intervals over prompts (summary.py), figures, takeaway
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from ..config_model import ConfigModel
from ..data import tasks as builtin_tasks
from ..data.examples import Dataset
from ..data.loading import DataSpec, load_data
from ..data.tokenized import TokenizedData, length_batches, pad, pad_answers, pad_id, tokenize_data
from ..errors import ConfigError, DataError, warn
from ..evaluate import TASK_METRICS  # each built-in task's score, as entoscope info reports it
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..metrics import Metric, check_metric_runs, metric_where
from ..memory import largest
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..operation import Operation, Plan, Prepared, progress, register_operation
from ..results.lazy import LazyTable
from ..results.result import Result
from .collect import READ_AT, difference
from .direction import Direction
from .figures import steering_figures
from .footprint import SteeringFootprint
from .generate import continue_batch, decoded
from .interventions import PositionRule, is_identity
from .rows import DIRECTION_SETS, SCORE, TASK, TEXT, RowSet, combine, split, tagged, without
from .runs import BatchRows, SteerSetup, steer_batch
from .scale import prompt_norms, scaled, typical_norm, unit_length, units_note
from .sites import site_notes, steerable, written_sites
from .sources import collect_sides, prompt_digest
from .spec import DirectionSpec
from .summary import prompt_rows, steering_table
from .takeaway import steering_takeaway

DEFAULT_COEFFICIENTS = {"add": [0.25, 0.5, 1.0, 2.0], "set": [0.0, 0.5, 1.0, 2.0], "project_out": [1.0]}


class SideEffects(ConfigModel):
    """What steering does to prompts the direction was not made from.

    tasks: built-in tasks whose score's change is measured (ioi: logit difference, facts and induction: top-1
           accuracy, greater_than: probability difference), n prompts each, seeded by seed.
    text:  more held-out text (a data spec): KL and loss change only.
    KL(steered || unsteered) and the loss change are averaged over every held-out prompt (tasks and text)."""

    tasks: list[str] = Field(default_factory=lambda: list(TASK_METRICS), description="built-in tasks whose score's "
                             "change is measured (ioi: logit difference; facts, induction: top-1 accuracy; "
                             "greater_than: probability difference)")
    n: int = Field(default=32, ge=1, le=100_000, description="held-out prompts per task")
    seed: int = Field(default=1729, description="seed of the held-out prompts")
    text: DataSpec | None = Field(default=None, description="more held-out text (a data spec): KL and loss change "
                                  "only")


class Continuations(ConfigModel):
    """Continuations of the first `prompts` task prompts, `tokens` new tokens each, steered and unsteered.
    sample: false is greedy; true draws from softmax(logits / temperature), seeded."""

    prompts: int = Field(default=3, ge=1, le=64, description="how many of the first task prompts are continued")
    tokens: int = Field(default=12, ge=1, le=256, description="new tokens per continuation")
    sample: bool = Field(default=False, description="false: greedy; true: drawn from softmax(logits / temperature), "
                         "seeded")
    temperature: float = Field(default=1.0, gt=0, description="the sampling temperature (sample: true)")


@dataclass(frozen=True)
class SteeringState:
    """What steering's prepare resolved: the run's tagged prompt sets and their batches, and where it writes."""

    sets: list[RowSet]  # the task, held-out sets and the direction's own prompts, each a range of rows
    tds: dict[str, TokenizedData]  # set name -> its tokenised prompts
    metrics: dict[str, Any]  # set name -> the metric read on it (None: KL and loss only)
    batches: list[list[int]]  # the rows of each length-grouped batch (never two sets in one)
    batch_set: list[str]  # the set of each batch
    setup: SteerSetup  # sites, mode, coefficients, positions (setup.vectors: filled per run by the phase context)
    direction: Direction | None  # the config's direction (None: the run makes it, phase "direction")
    pad: int  # the pad token id
    act: ActName  # the site the direction is read at
    width: int  # its vectors' width


@dataclass(frozen=True)
class SteerContext:
    """The steer phase's context (the driver's global step): the direction's vector, its random baseline's
    (same norm) and the direction's provenance."""

    vector: np.ndarray
    random: np.ndarray
    provenance: dict[str, Any]
    residual_norm: float | None = None  # R (units: residual_norm): the vectors are written at this length


@register_operation
class Steering(Sharded, Operation):
    """Steering: add a direction at a site (or clamp or project it out), with a dose-response and its side effects.

    direction:     where the vector comes from (DirectionSpec: mean_difference of pairs or two prompt sets, probe,
                   feature, file, vector; an es.Direction in Python).
    at:            where it is written (default: its own site); a list of sites, or "residual" (every point the
                   residual stream is read: Arditi et al. 2024).
    mode:          add (x + c v), set (the component along v set to c |v|), project_out (x - c (x.v^) v^).
    coefficients:  the dose-response (default by mode: add [0.25, 0.5, 1, 2], set [0, 0.5, 1, 2], project_out [1]).
    normalize:     use the unit vector (coefficients then in activation units).
    units:         what a coefficient multiplies: "direction" (c v, as given) or "residual_norm" (c R v^, R the
                   site's mean activation norm over the task prompts' positions, BOS left out; scale.py).
    positions:     all, last, last:K, generated, or a list of token indices and roles ([-1, S2, END]).
    metric:        the task metric read at each prompt's last token (logit_diff, prob, prob_diff, top1, ...).
    side_effects:  held-out prompts (built-in tasks, text): KL, loss change, task scores; null: none.
    continuations: steered and unsteered continuations of the first prompts; null: none.
    A random direction of the same norm at the same sites (seeded by seed) is the baseline of every number.
    """

    name = "steering"
    direction: DirectionSpec = Field(description="where the vector comes from: {source: mean_difference | probe | "
                                     "feature | file | vector, ...}, or an es.Direction in Python")
    at: str | list[str] | None = Field(default=None, description="where it is written (default its own site): a "
                                       "site, a list of sites, or residual (every point the residual stream is read; "
                                       "Arditi et al. 2024)")
    mode: Literal["add", "set", "project_out"] = Field(default="add", description="add (x + c v), set (the component "
                                                       "along v set to c |v|) or project_out (x - c (x.v^) v^)")
    coefficients: list[float] | None = Field(default=None, description="the dose-response's c values (default by "
                                             "mode: add [0.25, 0.5, 1, 2], set [0, 0.5, 1, 2], project_out [1])")
    normalize: bool = Field(default=False, description="use the unit vector (coefficients then in activation units)")
    units: Literal["direction", "residual_norm"] = Field(
        default="direction", description="what a coefficient multiplies: direction (c times the direction as "
        "given, or its unit vector with normalize) or residual_norm (c times R along the unit vector, R the mean "
        "L2 norm of the activation at the direction's site over the task prompts' positions, BOS left out: "
        "c = 0.1 adds a tenth of a typical activation's length; add and set only)")
    positions: str | list[int | str] = Field(default="all", description="all, last, last:K, generated, or a list of "
                                             "token indices and roles ([-1, S2, END])")
    metric: Metric = Field(default_factory=Metric, description="the task metric at each prompt's last token "
                           "(logit_diff, prob, prob_diff, top1, ...)")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")
    side_effects: SideEffects | None = Field(default_factory=SideEffects, description="held-out prompts (built-in "
                                             "tasks, text): KL, loss change, task scores; null: none")
    continuations: Continuations | None = Field(default=None, description="steered and unsteered continuations of "
                                                "the first prompts ({prompts, tokens, sample, temperature}); null: "
                                                "none")
    per_prompt: bool = Field(default=True, description="keep the per-prompt table")

    # ------------------------------------------------------------------ prepare: every check, and the plan
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[SteeringState]:
        assert data is not None
        coefficients = self._coefficients()
        self._check_units()
        rule = PositionRule.parse(self.positions)
        spec = self.direction
        if spec.pca and spec.negative is not None:
            raise DataError("the principal component is taken of paired differences, and direction.negative makes "
                            "two prompt sets, not pairs", code="direction_pca_needs_pairs",
                            remedy="drop negative (pairs: each prompt minus its counterfactual), or pca: false")
        direction = None if spec.made_by_run else spec.resolve(model)
        site = direction.site if direction is not None else spec.site_name()
        head = direction.head if direction is not None else spec.head
        act, width = steerable(model, site, head)
        if direction is not None and direction.width != width:
            raise DataError(f"the direction has width {direction.width}, and {act} holds vectors of width {width}",
                            code="direction_width", remedy=f"give a vector of width {width} (the site's last axis)")
        sites = written_sites(model, self.at, str(act), head, width)
        if direction is not None and self.units == "direction":  # residual_norm: checked once R is measured
            check_coefficients(direction.norm, coefficients, self.mode, self.normalize, model, where="")
        notes: list[str] = []
        combined = data if tagged(data) else self._combine(model, data, direction, notes)
        sets, parts = split(combined)
        tds = {name: self._tokenize(model, name, ds) for name, ds in parts.items()}
        metrics = {name: self._metric_of(name) for name in parts}
        for s in sets:
            if s.steered:
                rule.resolve(s.name, tds[s.name].roles, tds[s.name].lengths)
            elif spec.read_at not in READ_AT:
                rule_check = PositionRule("codes", given=[spec.read_at])
                rule_check.resolve(s.name, tds[s.name].roles, tds[s.name].lengths)
                if tds[s.name].counterfactuals is not None:
                    rule_check.resolve(s.name, tds[s.name].cf_roles, [len(c) for c in tds[s.name].counterfactuals])
        self._check_metric(model, tds[TASK])
        T = max(max(td.lengths) for td in tds.values())
        setup = SteerSetup(model, sites, head, self.mode, coefficients, rule, 1, self.normalize)
        steered = len(setup.steered_conditions())
        cont = self.continuations
        foot = SteeringFootprint(model, T, steered=steered > 0, tokens=cont.tokens if cont is not None else 0)
        size = self.choose_batch_size(0, len(combined), peak_of=lambda b: foot.peak(b, self.batch_size or 1))
        batches, batch_set = [], []
        for s in sets:
            td = tds[s.name]
            lengths = [max(len(p), len(c)) for p, c in zip(td.prompts, td.counterfactuals)] \
                if td.counterfactuals is not None and not s.steered else td.lengths
            for idx in length_batches(lengths, size):
                batches.append([s.lo + i for i in idx])
                batch_set.append(s.name)
        widest = max(len(b) for b in batches)  # a batch's rows: its prompts x the steered (or every) condition
        setup.rows = self.batch_size or largest(lambda r: foot.peak(widest, r), self.budget_bytes,
                                                widest * (setup.n_conditions if cont is not None else max(1, steered)))
        plan = self._plan(model, sets, tds, setup, batches, batch_set, foot, notes)
        state = SteeringState(sets, tds, metrics, batches, batch_set, setup, direction, pad_id(model), act, width)
        return Prepared(model, combined, plan, state)

    def _coefficients(self) -> list[float]:
        coefficients = list(self.coefficients) if self.coefficients is not None else DEFAULT_COEFFICIENTS[self.mode]
        if not coefficients:
            raise ConfigError("coefficients is empty: there is no dose to give", code="steering_coefficients",
                              remedy="give one or more coefficients, e.g. [0.5, 1, 2]")
        if len(set(coefficients)) != len(coefficients):
            raise ConfigError(f"coefficients {coefficients} repeat a value", code="steering_coefficients",
                              remedy="list each coefficient once")
        return [float(c) for c in coefficients]

    def _check_units(self) -> None:
        if self.units == "direction":
            return
        if self.normalize:
            raise ConfigError("normalize and units: residual_norm both set the length a coefficient of 1 writes",
                              code="steering_units", remedy="drop normalize (residual_norm already steers along the "
                              "unit vector), or use units: direction")
        if self.mode == "project_out":
            raise ConfigError("under project_out a coefficient is the share of the component removed, which has no "
                              "units", code="steering_units", remedy="leave units at direction for project_out")

    def _combine(self, model: ModelAdapter, data: Dataset, direction: Direction | None, notes: list[str]) -> Dataset:
        """The run's rows (rows.py): the task, held-out sets, the direction's own prompts."""
        spec = self.direction
        own: list[tuple[str, Dataset]] = []
        if spec.made_by_run:
            assert spec.data is not None
            first = load_data(spec.data, tokenizer=model.tokenizer)
            if spec.negative is None:
                own.append(("direction=", first))
            else:
                own += [("direction+", first), ("direction-", load_data(spec.negative, tokenizer=model.tokenizer))]
            digests = {prompt_digest(p) for _, ds in own for e in ds
                       for p in (e.prompt, e.counterfactual) if p is not None}
        else:
            assert direction is not None
            digests = set(direction.provenance.get("prompt_digests", []))
        held: list[tuple[str, Dataset]] = []
        if self.side_effects is not None:
            se = self.side_effects
            if se.text is not None:
                held.append((TEXT, load_data(se.text, tokenizer=model.tokenizer)))
            for name in se.tasks:
                builtin_tasks.check(name, {"n": se.n, "seed": se.seed})
                try:
                    prompts = builtin_tasks.get(name, n=se.n, seed=se.seed, tokenizer=model.tokenizer)
                    held.append((SCORE + name, prompts))
                except builtin_tasks.TaskVocabularyError as err:
                    warn(f"side effects: task {name!r} is left out: {err}", code="task_vocabulary")
        kept = []
        for name, ds in held:
            ds, dropped = without(ds, digests, prompt_digest)
            if dropped:
                notes.append(f"{dropped} held-out prompt(s) of {name} are prompts the direction was made from and are "
                             "left out")
            if len(ds):
                kept.append((name, ds))
        overlap = sum(prompt_digest(e.prompt) in digests for e in data)
        if overlap:
            warn(f"{overlap} of the {len(data)} task prompts are prompts the direction was made from: the effect there "
                 "is measured in-sample", code="steering_in_sample")
        if spec.made_by_run and spec.negative is None and not own[0][1].has_counterfactuals:
            raise DataError("a mean difference of pairs needs a counterfactual for every prompt of direction.data",
                            code="data_no_counterfactuals",
                            remedy="use a task with counterfactuals (ioi, greater_than, ...), or give "
                            "direction.negative")
        return combine(data, kept + own)

    def _tokenize(self, model: ModelAdapter, name: str, ds: Dataset) -> TokenizedData:
        answers = name == TASK or name.startswith(SCORE)
        if name == TASK and not ds.has_answers:
            raise DataError(f"steering measures its effect on the task metric, and {ds.name!r} has no answers",
                            code="data_no_answers", remedy="use data with answers (a built-in task, or answers in "
                            "each record)")
        return tokenize_data(model, ds, prepend_bos=self.prepend_bos, pairs=name == "direction=", answers=answers,
                             answer_scoring=self.answer_scoring if name == TASK else "first_token")

    def _metric_of(self, name: str) -> Any:
        if name == TASK:
            return self.metric.function()
        if name.startswith(SCORE):
            return Metric(type=TASK_METRICS[name[len(SCORE):]]).function()
        return None

    def _check_metric(self, model: ModelAdapter, td: TokenizedData) -> None:
        check_metric_runs(self.metric.function(), model, td)

    def _plan(self, model: ModelAdapter, sets: list[RowSet], tds: dict[str, TokenizedData], setup: SteerSetup,
              batches: list[list[int]], batch_set: list[str], foot: SteeringFootprint, notes: list[str]) -> Plan:
        steered = len(setup.steered_conditions())
        n_steer = sum(s.n for s in sets if s.steered)
        n_dir = sum(s.n * (2 if s.name == "direction=" else 1) for s in sets if not s.steered)
        cont = self.continuations
        generated = 0 if cont is None else min(cont.prompts, tds[TASK].__len__()) * setup.n_conditions * cont.tokens
        forward = n_steer * (1 + steered) + n_dir + generated + (sets[0].n if self.units == "residual_norm" else 0)
        sizes, rows = [len(b) for b in batches], setup.rows
        steer_rows = [len(b) * steered for b, name in zip(batches, batch_set) if name not in DIRECTION_SETS]
        sizes += [min(rows, n - i) for n in steer_rows for i in range(0, n, rows)]
        notes = list(notes) + site_notes(model, setup.sites, setup.head)
        notes.append(f"direction: {self.direction.describe()}; written at {', '.join(map(str, setup.sites))} "
                     f"({self.mode}, positions {self.positions}); baseline: a random direction of the same norm "
                     f"(seed {self.seed})")
        if self.mode != "project_out":
            notes.append(units_note(self.units, self.normalize) + (" (one more forward per task prompt measures R)"
                                                                   if self.units == "residual_norm" else ""))
        identity = [c for c in setup.coefficients if is_identity(self.mode, c)]
        if identity:
            notes.append(f"coefficient {identity[0]:g} changes nothing under {self.mode}: it is the unsteered run")
        if not setup.rule.steers_prompt:
            notes.append("positions: generated steers only the continuations; the metrics read at the prompt are the "
                         "unsteered ones")
        held = [s for s in sets if s.held_out]
        notes.append(f"rows: {sets[0].n} task prompts, {sum(s.n for s in held)} held-out prompts "
                     f"({', '.join(f'{s.name} {s.n}' for s in held) or 'none'})")
        peak = max(foot.peak(len(b), min(rows, len(b) * (setup.n_conditions if cont is not None else steered)))
                   for b in batches)
        files = ["table.csv", "table.parquet"] + (["per_prompt.csv", "per_prompt.parquet"] if self.per_prompt else []) \
            + ["direction.safetensors", "index.html", "manifest.json"]
        return Plan(self.name, rows=2 * len(setup.coefficients), forward_passes=forward, backward_passes=0,
                    batch_sizes=sizes, peak_memory_bytes=int(peak), notes=notes, examples=sum(sizes[:len(batches)]),
                    files=files)

    # ------------------------------------------------------------------ sharded phases (docs/scale.md)
    def shard_batches(self, prepared: Prepared[SteeringState]) -> list[list[int]]:
        return prepared.state.batches  # rows of the combined sets (lists of indices, not Batch records)

    def phases(self, prepared: Prepared[SteeringState]) -> tuple[str, ...]:
        return ("direction",) * self.direction.made_by_run + ("norm",) * (self.units == "residual_norm") + ("steer",)

    def global_step(self, prepared: Prepared[SteeringState]) -> str:
        made = "the mean difference of the direction prompts' vectors" if self.direction.made_by_run \
            else "the direction"
        norm = "; R, the task prompts' mean activation norm at the site" if self.units == "residual_norm" else ""
        return f"{made} and its random baseline (same norm, seed {self.seed}){norm}"

    def before_phase(self, prepared: Prepared[SteeringState], phase: str, merged: dict[str, Any]) -> Any:
        """Before steering: the direction (made here from the merged vectors, or the config's) and its random
        baseline, checked against the coefficients; they reach every shard as the phase's context."""
        if phase != "steer":
            return None
        st = prepared.state
        direction = st.direction if st.direction is not None else self._made(prepared, merged["direction"])
        R = None
        if self.units == "residual_norm":
            task = next(s for s in st.sets if s.name == TASK)
            block = merged["norm"].read(task.lo, task.hi, ["norm_sum", "norm_count"])
            R = typical_norm(block["norm_sum"], block["norm_count"], str(st.act))
        check_coefficients(unit_length(self.units, False, direction.norm, R), st.setup.coefficients, self.mode,
                           self.normalize, prepared.model, where=" (the direction the run made)"
                           if st.direction is None else "")
        random = direction.random_like(self.seed)
        return SteerContext(direction.vector.numpy(), random.vector.numpy(), direction.provenance, R)

    def _made(self, prepared: Prepared[SteeringState], columns: Any) -> Direction:
        st, spec = prepared.state, self.direction
        sets = {s.name: s for s in st.sets}
        if "direction=" in sets:
            s = sets["direction="]
            block = columns.read(s.lo, s.hi, ["act", "act_cf"])
            pos, neg, paired = block["act"], block["act_cf"], True
        else:
            pos = columns.read(sets["direction+"].lo, sets["direction+"].hi, ["act"])["act"]
            neg = columns.read(sets["direction-"].lo, sets["direction-"].hi, ["act"])["act"]
            paired = False
        vector, info = difference(pos, neg, paired=paired, pca=spec.pca)
        provenance = {"source": "pca" if spec.pca else "mean_difference", "site": str(st.act),
                      "read_at": spec.read_at, "pairs": paired,
                      **({"bos_in_mean": spec.bos_in_mean} if spec.read_at == "mean" else {}),
                      "data": spec.data.model_dump(exclude_defaults=True) if spec.data else None,
                      "negative": spec.negative.model_dump(exclude_defaults=True) if spec.negative else None, **info}
        return Direction(str(st.act), torch.from_numpy(vector), spec.head, provenance)

    def execute_shard(self, prepared: Prepared[SteeringState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        st = prepared.state
        examples = [i for bi in batches for i in st.batches[bi]]
        n = len(examples)
        if phase == "direction":
            arrays = {"act": np.full((n, st.width), np.nan, np.float32),
                      "act_cf": np.full((n, st.width), np.nan, np.float32)}
            row = 0
            for bi in batches:
                idx, name = st.batches[bi], st.batch_set[bi]
                if name in DIRECTION_SETS:
                    self._direction_batch(prepared, name, idx, arrays, row)
                row += len(idx)
            return PerPrompt(examples, arrays)
        if phase == "norm":
            return self._norm_shard(prepared, batches, examples)
        setup = st.setup
        context: SteerContext = prepared.contexts[phase]
        setup.vectors = scaled(torch.stack([torch.from_numpy(context.vector), torch.from_numpy(context.random)]),
                               self.units, context.residual_norm)
        C = setup.n_conditions
        arrays = {k: np.full((n, C), np.nan) for k in ("metric", "kl", "loss")}
        cont = self.continuations
        if cont is not None:
            arrays["continuation"] = np.full((n, C, cont.tokens), -1, dtype=np.int64)
        todo = [bi for bi in batches if st.batch_set[bi] not in DIRECTION_SETS]
        steps = sum(-(-len(st.batches[bi]) * len(setup.steered_conditions()) // setup.rows) for bi in todo)
        bar = iter(progress(range(steps), total=steps, desc="steering", quiet=quiet))
        row = 0
        for bi in batches:
            idx, name = st.batches[bi], st.batch_set[bi]
            if name not in DIRECTION_SETS:
                batch = self._batch_rows(prepared, name, idx, bi)
                out = steer_batch(setup, batch, lambda: next(bar, None))
                for k, v in out.items():
                    arrays[k][row:row + len(idx)] = v
                if cont is not None and name == TASK:
                    self._continue(prepared, setup, batch, idx, arrays["continuation"], row)
            row += len(idx)
        return PerPrompt(examples, arrays)

    def _norm_shard(self, prepared: Prepared[SteeringState], batches: list[int], examples: list[int]) -> PerPrompt:
        """Phase norm: each task prompt's sum of activation norms at the site and its positions (scale.py)."""
        st = prepared.state
        arrays = {"norm_sum": np.zeros(len(examples)), "norm_count": np.zeros(len(examples), np.int64)}
        bos = prepared.model.bos_token_id if self.prepend_bos else None
        row = 0
        for bi in batches:
            idx = st.batches[bi]
            if st.batch_set[bi] == TASK:
                batch = self._batch_rows(prepared, TASK, idx, bi)
                sums, counts = prompt_norms(prepared.model, batch.tokens, batch.lengths, st.act, st.setup.head, bos)
                arrays["norm_sum"][row:row + len(idx)], arrays["norm_count"][row:row + len(idx)] = sums, counts
            row += len(idx)
        return PerPrompt(examples, arrays)

    def _direction_batch(self, prepared: Prepared[SteeringState], name: str, idx: list[int],
                         arrays: dict[str, np.ndarray], row: int) -> None:
        st = prepared.state
        s = next(x for x in st.sets if x.name == name)
        local = [i - s.lo for i in idx]
        pos, neg = collect_sides(prepared.model, st.tds[name], local, st.act, st.setup.head,
                                 self.direction.read_at, pairs=name == "direction=", batch_size=len(local),
                                 bos_in_mean=self.direction.bos_in_mean)
        arrays["act"][row:row + len(idx)] = pos
        if neg is not None:
            arrays["act_cf"][row:row + len(idx)] = neg

    def _batch_rows(self, prepared: Prepared[SteeringState], name: str, idx: list[int], bi: int) -> BatchRows:
        st = prepared.state
        s = next(x for x in st.sets if x.name == name)
        td = st.tds[name]
        local = [i - s.lo for i in idx]
        tokens, lengths = pad([td.prompts[i] for i in local], st.pad)
        answers = wrong = None
        if td.answers is not None:
            answers = pad_answers([td.answers[i] for i in local])
            wrong = pad_answers([td.wrong_answers[i] for i in local])
        roles = None if td.roles is None else td.roles.subset(local)
        where = f"{name} prompts {local[0]}..{local[-1]} (batch {bi + 1} of {len(st.batches)})"
        return BatchRows(name, tokens, lengths, roles, answers, wrong, st.metrics[name], where)

    def _continue(self, prepared: Prepared[SteeringState], setup: SteerSetup, batch: BatchRows, idx: list[int],
                  out: np.ndarray, row: int) -> None:
        cont = self.continuations
        assert cont is not None
        chosen = [r for r, i in enumerate(idx) if i < cont.prompts]
        if not chosen:
            return
        tokens = continue_batch(setup, batch, chosen, [idx[r] for r in chosen], cont.tokens, cont.sample,
                                cont.temperature, self.seed, prepared.state.pad)
        out[[row + r for r in chosen]] = tokens

    # ------------------------------------------------------------------ summarise
    def summarise(self, prepared: Prepared[SteeringState], merged: dict[str, Any], *, quiet: bool = False) -> Result:
        st = prepared.state
        setup = st.setup
        context: SteerContext = prepared.contexts["steer"]
        columns = merged["steer"]
        direction = Direction(str(st.act), torch.from_numpy(context.vector), setup.head, context.provenance)
        random = Direction(str(st.act), torch.from_numpy(context.random), setup.head,
                           {"source": "random", "seed": self.seed})
        info = {"mode": self.mode, "site": ", ".join(map(str, setup.sites)), "metric": self.metric.type,
                "direction_norm": direction.norm, "units": self.units,
                **({"residual_norm": context.residual_norm} if context.residual_norm is not None else {})}
        unit = unit_length(self.units, self.normalize, direction.norm, context.residual_norm)
        with metric_where("summary"):
            table = steering_table(columns, st.sets, setup.coefficients, info, self.stats, self.seed)
        table.insert(table.columns.get_loc("coefficient") + 1, "written_norm",
                     np.nan if self.mode == "project_out" else table["coefficient"].abs() * unit)
        per_prompt = None
        if self.per_prompt:
            def rows(lo: int, hi: int) -> Any:
                return prompt_rows(columns, st.sets, setup.coefficients, lo, hi)
            per_prompt = LazyTable(len(prepared.data), rows, rows_per_prompt=2 * len(setup.coefficients))
        extra: dict[str, Any] = {"direction": direction, "random": random, "sets": st.sets,
                                 "written_at": setup.sites,
                                 "direction_source": str(direction.provenance.get("source", "given")),
                                 "direction_where": direction.where}
        if self.continuations is not None:
            extra["continuations"] = self._continuation_frame(prepared, columns, setup)
        title = f"steering {', '.join(map(str, setup.sites))} ({self.mode}): {self.metric.type}"
        return SteeringResult(self.name, table, per_prompt=per_prompt, figures=steering_figures, title=title,
                              extra=extra, takeaway=steering_takeaway,
                              blank_note="minus_random is blank on the random rows (they are the baseline)")

    def _continuation_frame(self, prepared: Prepared[SteeringState], columns: Any, setup: SteerSetup) -> Any:
        import pandas as pd

        cont = self.continuations
        assert cont is not None
        st = prepared.state
        n = min(cont.prompts, st.sets[0].n)
        ids = columns.read(0, n, ["continuation"])["continuation"]
        vocab = prepared.model.vocab_strings()
        stop = getattr(prepared.model.tokenizer, "eos_token_id", None)
        prompts = st.tds[TASK].prompts
        rows = []
        for i in range(n):
            text = "".join(vocab[t] for t in prompts[i][1 if self.prepend_bos else 0:])
            row = {"prompt": text, "unsteered": decoded(vocab, ids[i, 0], stop)}
            for j in range(1, setup.n_conditions):
                which, c = setup.condition(j)
                row[f"{'random' if which else 'direction'} c={c:g}"] = decoded(vocab, ids[i, j], stop)
            rows.append(row)
        return pd.DataFrame(rows)

    def run(self, model: Any, data: Any = None, **kwargs: Any) -> Any:
        """Operation.run, with the direction's provenance recorded in the manifest."""
        result = super().run(model, data, **kwargs)
        result.manifest["direction"] = {"site": result.extra["direction"].site, "head": result.extra["direction"].head,
                                        "norm": result.extra["direction"].norm,
                                        "provenance": result.extra["direction"].provenance,
                                        "written_at": [str(s) for s in result.extra.get("written_at", [])],
                                        "units": self.units}
        if "residual_norm" in result.table:  # R, what the coefficients multiplied (scale.py)
            result.manifest["direction"]["residual_norm"] = float(result.table["residual_norm"].iloc[0])
        return result


class SteeringResult(Result):
    """A Result that also saves the direction and its random baseline (direction.safetensors) and the
    continuations (continuations.csv)."""

    def save_extra(self, folder: Path, files: list[str]) -> None:
        path = self.extra["direction"].save(folder, random=self.extra["random"])
        files.append(path.name)
        frame = self.extra.get("continuations")
        if frame is not None:
            frame.to_csv(folder / "continuations.csv", index=False)
            files.append("continuations.csv")


def check_coefficients(norm: float, coefficients: list[float], mode: str, normalize: bool, model: ModelAdapter,
                       where: str) -> None:
    """Refuse, before any run, a coefficient whose write alone would overflow the model's dtype: |c| |v| at least
    sqrt(the dtype's largest number), where the square in the next norm is inf."""
    dtype = next(model.module.parameters()).dtype
    limit = float(torch.finfo(dtype).max) ** 0.5 if dtype.is_floating_point else float("inf")
    scale = 1.0 if normalize else norm
    for c in coefficients:
        if mode != "project_out" and abs(c) * scale >= limit:
            raise ConfigError(f"coefficient {c:g}{where} writes a vector of norm {abs(c) * scale:.3g}: the next norm's "
                              f"square overflows {str(dtype).removeprefix('torch.')} (limit about {limit:.3g})",
                              code="steering_coefficient_overflow",
                              remedy="use smaller coefficients (the direction's norm is "
                              f"{norm:.4g}; normalize: true makes coefficients activation units)")

