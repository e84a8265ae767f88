"""The probing operation: where does a model represent a property of its input?

Collect one feature vector per prompt at every site (batched forwards, `collect.py`), fit one linear
probe per site (`fit_probes`: standardised features, regularisation chosen on validation rows only,
scored once on held-out test rows), compare with the same probe on control labels (Hewitt & Liang
2019: selectivity = held-out score minus the control's), and optionally ablate the probe direction
in the model's forward pass to see whether the model uses it (`causal.py`). docs/probing.md has the
method, the conventions and the references.

Table: one row per site. test_* are held-out scores (the result; mean over folds, `_std` the sample
std over folds, `_ci_low` / `_ci_high` the bootstrap interval over the held-out prompts, all folds'
held-out predictions pooled: `intervals.py`); control_test_*, selectivity (with its interval); train_* are training-row scores (a measure of fit,
labelled as such, never the result); C / alpha chosen on validation rows; causal columns for the
checked sites. per_prompt: every held-out prediction. Directions are saved as safetensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id
from ..errors import ConfigError, DataError
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt, as_numpy
from ..models.footprint import FIXED, Footprint
from ..models.adapter import ModelAdapter
from ..operation import Operation, Plan, Prepared, register_operation
from ..results.result import Result
from ..sites import Sites
from .causal import (CausalCheck, causal_intervals, check_units, chosen_sites, fold_testing_each, run_causal_check,
                     validate_site_labels)
from .collect import CollectionSetup, collect, empty_collection, reads_of, setup_collection
from .figures import probing_figures
from .intervals import held_out_values, summarise_probing
from .fit import DEFAULT_ALPHA_GRID, DEFAULT_C_GRID, MEMORY_BUDGET, _check_split, _encode_labels, _make_splits, \
    fit_probes
from .pooling import Pooling
from .predict import held_out_predictions, held_out_scores, label_codes
from .result import ProbeFit
from .takeaway import probing_takeaway

FILES = ["table.csv", "table.parquet", "per_prompt.csv", "per_prompt.parquet", "index.html", "manifest.json",
         "directions.safetensors", "directions.json"]
RESIDUAL_KINDS = ("embed", "pos_embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "result")


@dataclass(frozen=True)
class ProbingState:
    """What probing's prepare resolved (labels encoded, splits checked, sites read how)."""

    cs: CollectionSetup  # the tokenised data, units, pooling and where they are read
    batches: list[Batch]
    labels: list[Any]  # one per example
    task: str  # "classification" or "regression"
    groups: list[Any] | None  # control: groups: each example's group
    grid: list[float]  # the regularisation grid (C or alpha)
    metric_fn: Any  # the causal check's task metric (None without one)


@register_operation
class Probing(Sharded, Operation):
    """Linear probes per site on held-out data, against a control task, with an optional causal check.

    sites:        where to read (default: every layer's resid_post). With a position axis each row reads
                  its position (negative: from each prompt's end); without one, `pooling` reduces positions.
    pooling:      mean, max, first, last (default), marked / index ({type, key, occurrence}: a position
                  per prompt from a meta key), or one you registered (kind "pooling").
    head_pooling: per-head kinds read without a head axis: concat (default), mean, sum (kind "head_pooling").
    labels:       "label" (each example's label) or a meta key ("meta.order" or "order").
    task:         auto (strings, bools and integers with at most max_classes values: classification;
                  other numbers: regression), classification (logistic) or regression (ridge).
    split:        holdout (train/val/test fractions) or kfold (k folds: test, validation, training).
    C_grid / alpha_grid: regularisation tried; chosen per site on validation rows only.
    control:      shuffle (permuted labels), groups (one random label per value of meta `group_by`:
                  Hewitt & Liang's type-level control) or null.
    causal_check: ablate the probe directions during the forward pass (see CausalCheck).
    fit_device:   where probes are fitted (default: the model's device); precision: float64 or float32.
    lens_top_k:   residual-basis sites of binary/regression probes: the tokens each direction
                  promotes and suppresses through W_U (the parameter lens; 0: off).
    per_prompt:   keep every held-out prediction.
    """

    name = "probing"
    sites: Sites = Field(default_factory=lambda: Sites(activation="resid_post", over=["layer"]), description="where "
                         "to read (default every layer's resid_post); with a position axis each row reads its "
                         "position, else pooling reduces the positions")
    pooling: Pooling | None = Field(default=None, description="positions pooled without a position axis: mean, max, "
                                    "first, last (default), marked / index ({type, key, occurrence}), or a "
                                    "registered pooling")
    head_pooling: str = Field(default="concat", description="per-head kinds read without a head axis: concat, mean, "
                              "sum, or a registered one")
    labels: str = Field(default="label", description="label (each example's label) or a meta key (meta.order or "
                        "order)")
    task: Literal["auto", "classification", "regression"] = Field(default="auto", description="auto (strings, bools "
        "and integers with at most max_classes values: classification; other numbers: regression), classification "
        "(logistic) or regression (ridge)")
    max_classes: int = Field(default=32, ge=2, description="auto: integer labels with at most this many values are "
                             "classes")
    split: Literal["holdout", "kfold"] = Field(default="holdout", description="holdout (train / val / test "
                                               "fractions) or kfold (k folds: test, validation, training)")
    k: int = Field(default=5, ge=3, description="kfold: the number of folds")
    val_fraction: float = Field(default=0.2, gt=0, lt=1, description="holdout: the share of examples that chooses "
                                "the regularisation")
    test_fraction: float = Field(default=0.2, gt=0, lt=1, description="holdout: the share of examples held out for "
                                 "the test scores")
    C_grid: list[float] | None = Field(default=None, description="classification: inverse regularisation strengths "
                                       "tried per site on validation rows; default 1e-4 ... 1e2")
    alpha_grid: list[float] | None = Field(default=None, description="regression: ridge penalties tried per site on "
                                           "validation rows; default 1e5 ... 1e-2")
    control: Literal["shuffle", "groups"] | None = Field(default="shuffle", description="shuffle (permuted labels), "
        "groups (one random label per value of meta group_by: Hewitt & Liang 2019) or null")
    group_by: str | None = Field(default=None, description="control groups: the meta key whose values share one "
                                 "random label")
    causal_check: CausalCheck | None = Field(default=None, description="ablate the probe directions in the forward "
                                             "pass and read the task metric ({sites, top, metric, random_baseline})")
    fit_device: str | None = Field(default=None, description="where probes are fitted (default: the model's device)")
    precision: Literal["float64", "float32"] = Field(default="float64", description="the probes' fitting precision: "
                                                     "float64 or float32")
    lens_top_k: int = Field(default=5, ge=0, le=50, description="binary / regression probes at residual sites: the "
                            "tokens each direction promotes and suppresses through W_U (0: off)")
    per_prompt: bool = Field(default=True, description="keep every held-out prediction")

    # ------------------------------------------------------------------ prepare: every check, and the plan
    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[ProbingState]:
        assert data is not None
        labels = self._labels(data)
        task = infer_task(labels, self.max_classes) if self.task == "auto" else self.task
        y_enc, classes = _encode_labels(labels, task)
        grid = self._grid(task)
        splits_kind, splits = _make_splits(self.split, y_enc, k=self.k, seed=self.seed,
                                           val_fraction=self.val_fraction, test_fraction=self.test_fraction,
                                           stratify=task == "classification")
        K = len(classes) if classes is not None else None
        for f, sp in enumerate(splits):
            _check_split(sp, len(labels), y_enc, K, len(grid) > 1, f)
        groups = self._groups(data)
        check = self.causal_check
        cs = setup_collection(model, data, self.sites, self.pooling, self.head_pooling, prepend_bos=self.prepend_bos,
                              answers=check is not None,
                              answer_scoring=check.answer_scoring if check else "first_token")
        metric_fn = None
        site_labels = [u.label for u in cs.units]
        if len(set(site_labels)) != len(site_labels):
            raise ConfigError("two probed sites have the same label", code="config_invalid",
                              remedy="drop duplicated coordinates / groups from sites")
        if check is not None:
            metric_fn = check.metric.function()
            _check_metric(metric_fn, model, cs.td)
            check_units(model, cs.units, validate_site_labels(check, site_labels), self.head_pooling)
        reads = reads_of(cs.units)
        T = max(cs.td.lengths)
        N = len(cs.td)
        fp = Footprint(model)  # the reads and a forward (its logits only when a causal check scores them)
        per_example = fp.act(reads, 1, T) + fp.forward(1, T, logit_rows=None if metric_fn is not None else 0)
        sizes = [u.size for u in cs.units]
        n_checked = check.n_sites(len(cs.units)) if check else 0
        # per checked site: the ablated run, the random baseline's, and with several folds a read-only
        # re-collection with each fold's own direction removed: one for every fold where their test rows are
        # disjoint (k-fold), else one per fold (causal._own_direction_scores)
        fold_of = fold_testing_each([sp.test for sp in splits], N) if len(splits) > 1 else None
        refolds = 0 if len(splits) == 1 else 1 if fold_of is not None else len(splits)
        per_site = 1 + int(bool(check and check.random_baseline)) + refolds
        forwards = N * (1 + n_checked * per_site)
        fit_bytes = min(MEMORY_BUDGET, 8 * len(sizes) * (4 * N * max(sizes) + 12 * N * (K or 1)))
        # after the collection (the activations kept): the fits, then the lens columns' [sites, vocabulary] scores
        # through W_U and their negation (_lens_columns: binary and regression probes of residual sites)
        lens = 0
        if self.lens_top_k and cs.siteset.kind.name in RESIDUAL_KINDS and (K is None or K <= 2):
            S = sum(u.size == model.structure.d_model and len(u.members) == 1 for u in cs.units)
            lens = 2 * S * model.structure.d_vocab * fp.f

        def peak(b: int) -> int:  # the collected activations kept throughout
            return FIXED + 4 * N * sum(sizes) + max(b * per_example, fit_bytes + lens)
        bs = self.choose_batch_size(0, N, peak_of=peak)
        batches = make_batches(cs.td, bs, pad_id(model))
        notes = list(cs.notes)
        classes_note = f" ({len(classes)} classes)" if classes is not None else ""
        notes.append(f"task: {task}{classes_note}; labels from {self.labels!r}; split {splits_kind} "
                     f"({len(splits)} fold(s)); control {self.control}")
        if check:
            parts = ["ablated"] + (["random baseline"] if check.random_baseline else []) + \
                ([f"{len(splits)} folds' own directions re-collected"
                  + (" in one pass, each prompt by the fold that tests it" if refolds == 1 else "")]
                 if len(splits) > 1 else [])
            notes.append(f"causal check: {n_checked} site(s) ablated, metric {check.metric.type}; per site "
                         f"{per_site} pass(es) over the prompts ({', '.join(parts)})")
        plan = Plan(self.name, rows=len(cs.units), forward_passes=forwards, backward_passes=0,
                    batch_sizes=[len(b) for b in batches], examples=N,
                    peak_memory_bytes=peak(bs),
                    files=FILES + (["causal_per_prompt.csv"] if check else []), notes=notes)
        return Prepared(model, data, plan, ProbingState(cs, batches, labels, task, groups, grid, metric_fn))

    def _labels(self, data: Dataset) -> list[Any]:
        key = None if self.labels == "label" else self.labels.removeprefix("meta.")
        values = []
        for i, e in enumerate(data):
            if key is None:
                if e.label is None:
                    raise DataError(f"example {i} has no label", code="data_no_labels",
                                    remedy="use data with labels (ioi, facts, greater_than, or a 'label' field), "
                                    "or labels: <meta key>")
                values.append(e.label)
            else:
                if key not in e.meta:
                    raise DataError(f"example {i} has no meta field {key!r} to take labels from",
                                    code="data_field_missing", remedy=f"known meta fields: {sorted(e.meta)}")
                values.append(e.meta[key])
        bad = [v for v in values if not isinstance(v, (str, int, float, np.generic))]
        if bad:
            raise DataError(f"labels must be strings or numbers, got {type(bad[0]).__name__} ({bad[0]!r})",
                            remedy="take labels from a field that holds one value per example")
        return values

    def _grid(self, task: str) -> list[float]:
        given = self.C_grid if task == "classification" else self.alpha_grid
        default = DEFAULT_C_GRID if task == "classification" else DEFAULT_ALPHA_GRID
        grid = list(given if given is not None else default)
        if not grid or any(not (g > 0 and math.isfinite(g)) for g in grid):
            raise ConfigError(f"the regularisation grid must be positive finite numbers, got {grid}",
                              remedy="e.g. C_grid: [0.01, 0.1, 1, 10]")
        return grid

    def _groups(self, data: Dataset) -> list[Any] | None:
        if self.control != "groups":
            if self.group_by is not None:
                raise ConfigError("group_by is only used by control: groups",
                                  remedy="set control: groups, or drop group_by")
            return None
        if self.group_by is None:
            raise ConfigError("control: groups needs group_by, the meta field that names each example's group",
                              remedy="e.g. group_by: template (IOI, facts) or group_by: country (facts)")
        missing = [i for i, e in enumerate(data) if self.group_by not in e.meta]
        if missing:
            raise DataError(f"{len(missing)} examples have no meta field {self.group_by!r} (first: {missing[:5]})",
                            code="data_field_missing", remedy="group by a meta field every example has")
        return [str(e.meta[self.group_by]) for e in data]

    # ------------------------------------------------------------------ execute (sharded: docs/scale.md)
    # a shard collects its prompts' features (and task metric); the probes are fitted on the driver from the
    # merged features (the global step: splits and folds need every prompt), then the causal check runs there.
    def global_step(self, prepared: Prepared) -> str:
        return "probe fitting on the merged features" + (" and the causal check" if self.causal_check else "")

    def execute_shard(self, prepared: Prepared[ProbingState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        cs = st.cs
        mine = [st.batches[i] for i in batches]
        examples = [i for b in mine for i in b.index]
        collected = collect(model, mine, cs.units, cs.pool, cs.at, cs.head_pooling, len(examples),
                            metric=st.metric_fn, quiet=quiet, desc="probing: collect",
                            row_of={ex: j for j, ex in enumerate(examples)})
        arrays = {f"features_{F}": as_numpy(X.permute(1, 0, 2)) for F, X in collected.buckets.items()}  # [n, U_F, F]
        if collected.metric is not None:
            arrays["metric"] = as_numpy(collected.metric)
        return PerPrompt(examples, arrays)

    def summarise(self, prepared: Prepared[ProbingState], merged: dict[str, Any], *,
                  quiet: bool = False) -> ProbingResult:
        model, st = prepared.model, prepared.state
        cs = st.cs
        m = merged["main"]
        collected = empty_collection(cs.units, 0, torch.float32, model.device)
        collected.buckets = {F: torch.from_numpy(m[f"features_{F}"]).permute(1, 0, 2).contiguous().to(model.device)
                             for F in collected.bucket_units}
        collected.metric = torch.from_numpy(m["metric"]) if "metric" in m else None
        fits: dict[int, ProbeFit] = {}
        for F, idx in collected.bucket_units.items():
            fits[F] = self._fit(collected.buckets[F], st, [cs.units[i].label for i in idx], control=self.control)
        where = {i: (F, j) for F, idx in collected.bucket_units.items() for j, i in enumerate(idx)}
        codes = {F: label_codes(fit, st.labels) for F, fit in fits.items()}
        intervals = pd.concat([summarise_probing(held_out_values(fits[F], collected.buckets[F], codes[F]),
                                                 self.stats, self.seed) for F in fits], ignore_index=True)
        table = self._table(model, cs, fits, collected.bucket_units, intervals)
        per_prompt = None
        if self.per_prompt:
            per_prompt = pd.concat([held_out_predictions(fits[F], collected.buckets[F], codes[F], st.labels,
                                                         [cs.units[i].label for i in idx])
                                    for F, idx in collected.bucket_units.items()], ignore_index=True)
        causal_frame = None
        if self.causal_check is not None:
            table, causal_frame = self._causal(model, st, cs, fits, where, collected, table, quiet)
        title = f"probing {self.labels!r} at {cs.siteset.kind.name}: held-out score against a control task, by site"
        extra: dict[str, Any] = {"fits": fits, "site_labels": [u.label for u in cs.units]}
        if len(fits) == 1:
            extra["fit"] = next(iter(fits.values()))
        if causal_frame is not None:
            extra["causal_per_prompt"] = causal_frame
        return ProbingResult(self.name, table, per_prompt=per_prompt, figures=probing_figures, title=title,
                             extra=extra, takeaway=probing_takeaway)

    def _fit(self, X: torch.Tensor, st: ProbingState, site_names: list[str], control: str | None) -> ProbeFit:
        task = st.task
        return fit_probes(X, st.labels, task, split=self.split, k=self.k, seed=self.seed,
                          val_fraction=self.val_fraction, test_fraction=self.test_fraction,
                          C_grid=st.grid if task == "classification" else None,
                          alpha_grid=st.grid if task == "regression" else None,
                          control=control, groups=st.groups if control == "groups" else None,
                          site_names=site_names, device=self.fit_device,
                          dtype=torch.float64 if self.precision == "float64" else torch.float32)

    def _table(self, model: ModelAdapter, cs: Any, fits: dict[int, ProbeFit],
               bucket_units: dict[int, list[int]], intervals: pd.DataFrame) -> pd.DataFrame:
        frames = []
        for F, idx in bucket_units.items():
            fit = fits[F]
            frame = fit.to_frame()
            frame.insert(1, "unit", idx)
            frame.insert(2, "features", F)
            frame["n_test"] = float(np.mean([sp.test.numel() for sp in fit.splits]))
            frames.append(_with_intervals(frame, intervals))
        table = pd.concat(frames, ignore_index=True).sort_values("unit", kind="stable").reset_index(drop=True)
        axes = cs.siteset.frame().drop(columns=["site"])
        layers = [u.get("layer") for u in cs.siteset.units]
        if "layer" not in axes and any(v is not None for v in layers):  # a layer fixed by the activation name
            axes.insert(0, "layer", layers)
        if "pos" not in cs.siteset.over and "position" not in axes:
            axes["position"] = cs.pooling.type + (f":{cs.pooling.key}" if cs.pooling.key else "")
        table = pd.concat([table[["site"]], axes.reset_index(drop=True), table.drop(columns=["site"])], axis=1)
        table.insert(1, "activation", cs.siteset.kind.name)
        if self.lens_top_k:
            table = self._lens_columns(model, cs, fits, bucket_units, table)
        return table.drop(columns=["unit"])

    def _lens_columns(self, model: ModelAdapter, cs: Any, fits: dict[int, ProbeFit],
                      bucket_units: dict[int, list[int]], table: pd.DataFrame) -> pd.DataFrame:
        """Tokens each residual-basis direction pushes up / down through W_U (binary and regression)."""
        d_model = model.structure.d_model
        if cs.siteset.kind.name not in RESIDUAL_KINDS or d_model not in fits:
            return table
        fit = fits[d_model]
        if fit.directions.shape[1] != 1:
            return table
        idx = [i for i in bucket_units[d_model] if len(cs.units[i].members) == 1]
        if not idx:
            return table
        rows = [bucket_units[d_model].index(i) for i in idx]
        W_U = model.weights.W_U
        with torch.no_grad():
            scores = fit.directions[rows, 0].to(W_U.device, W_U.dtype) @ W_U  # [S', V]
        vocab = model.vocab_strings()
        k = min(self.lens_top_k, scores.shape[-1])
        top = scores.topk(k, -1).indices.cpu()
        bottom = (-scores).topk(k, -1).indices.cpu()
        up = {i: [vocab[t] for t in top[r].tolist()] for r, i in enumerate(idx)}
        down = {i: [vocab[t] for t in bottom[r].tolist()] for r, i in enumerate(idx)}
        table["lens_up"] = [" | ".join(up[i]) if i in up else None for i in table["unit"]]
        table["lens_down"] = [" | ".join(down[i]) if i in down else None for i in table["unit"]]
        return table

    def _causal(self, model: ModelAdapter, st: ProbingState, cs: Any, fits: dict[int, ProbeFit],
                where: dict[int, tuple[int, int]], collected: Any, table: pd.DataFrame,
                quiet: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
        check = self.causal_check
        assert check is not None and collected.metric is not None
        primary = "accuracy" if st.task == "classification" else "r2"
        rank_by = "selectivity" if "selectivity" in table else f"test_{primary}"
        chosen = chosen_sites(check, list(table["site"]), table[rank_by].to_numpy(dtype=float))
        check_units(model, cs.units, chosen, self.head_pooling)
        codes = {F: label_codes(fit, st.labels) for F, fit in fits.items()}

        def directions_of(u: int) -> torch.Tensor:
            F, j = where[u]
            return fits[F].directions[j]

        def fold_directions_of(u: int) -> torch.Tensor:
            F, j = where[u]
            return fits[F].fold_directions[:, j]

        def held_out(u: int, X: torch.Tensor) -> dict[str, torch.Tensor]:
            F, j = where[u]
            return {m: v[:, 0] for m, v in held_out_scores(fits[F], X[None], codes[F], sites=[j]).items()}

        def refit(u: int, X: torch.Tensor) -> dict[str, torch.Tensor]:
            fit = self._fit(X[None], st, [cs.units[u].label], control=None)
            return {m: v[:, 0] for m, v in fit.test.items()}

        # every fit's splits are the same (_make_splits on the same labels and seed): the folds' test rows
        tests = [sp.test for sp in next(iter(fits.values())).splits]
        fold_of = fold_testing_each(tests, len(cs.td)) if len(tests) > 1 else None
        summary, per_prompt = run_causal_check(
            model, st.batches, cs.units, chosen, cs.pool, cs.at, cs.head_pooling, len(cs.td),
            directions_of=directions_of, fold_directions_of=fold_directions_of, held_out=held_out, refit=refit, primary=primary, check=check,
            metric_fn=st.metric_fn, metric_base=collected.metric, seed=self.seed, quiet=quiet,
            fold_of=fold_of)
        summary = summary.merge(causal_intervals(per_prompt, self.stats, self.seed), on="site", how="left")
        return table.merge(summary, on="site", how="left"), per_prompt


class ProbingResult(Result):
    """A Result that also saves each fit's directions (safetensors + JSON) and the causal check per prompt."""

    def save_extra(self, folder: Path, files: list[str]) -> None:
        fits: dict[int, ProbeFit] = self.extra.get("fits", {})
        for F, fit in fits.items():
            name = "directions" if len(fits) == 1 else f"directions_d{F}"
            path = fit.save_directions(folder / f"{name}.safetensors")
            files += [path.name, path.with_suffix(".json").name]
        causal = self.extra.get("causal_per_prompt")
        if causal is not None:
            causal.to_csv(folder / "causal_per_prompt.csv", index=False)
            files.append("causal_per_prompt.csv")


def _with_intervals(frame: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """The fit's table with each test_* / selectivity column followed by its interval columns."""
    by_site = intervals.set_index("site").reindex(frame["site"]).reset_index(drop=True)
    out = frame.copy()
    for col in [c for c in by_site.columns if c not in ("n_held_out", "ci_level")]:
        base = col.rsplit("_ci_", 1)[0].removesuffix("_se")
        at = list(out.columns).index(base) + 1 if base in out.columns else len(out.columns)
        while at < len(out.columns) and out.columns[at].startswith(base + "_"):
            at += 1
        out.insert(at, col, by_site[col].to_numpy())
    out["n_held_out"] = by_site["n_held_out"].to_numpy()
    out["ci_level"] = by_site["ci_level"].to_numpy()
    return out


def infer_task(labels: list[Any], max_classes: int = 32) -> str:
    """classification for strings, bools and integers with at most `max_classes` distinct values;
    regression for other numbers."""
    if any(isinstance(v, str) for v in labels) or all(isinstance(v, (bool, np.bool_)) for v in labels):
        return "classification"
    values = np.asarray(labels, dtype=np.float64)
    if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
        return "regression"
    return "classification" if len(np.unique(values)) <= max_classes else "regression"


def _check_metric(metric: Any, model: ModelAdapter, td: Any) -> None:
    """Call the metric once on stand-in logits so that one the data cannot serve is refused now."""
    V = model.structure.d_vocab
    answers = torch.tensor([td.answers[0] or [-1]])
    wrong = torch.tensor([td.wrong_answers[0] or [-1]])
    out = metric(torch.zeros(1, V), answers, wrong, None)
    if not isinstance(out, torch.Tensor) or out.shape != (1,):
        raise ConfigError(f"the metric returned {getattr(out, 'shape', type(out))} for one prompt",
                          code="metric_shape", remedy="a metric returns one value per row: shape [B]")
