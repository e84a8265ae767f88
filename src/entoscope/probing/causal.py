"""The causal check of a probe direction: project it out at its site during the forward pass.

Decodable is not used (Belinkov 2022). For each checked site, every prompt is run again with the
probe's direction(s) removed from the activation the probe read (x <- x - (x Q) Q^T, Q an
orthonormal basis of the site's directions: one for a binary or regression probe, one per class
for a multi-class probe; `project_out`, as in amnesic probing, Elazar et al. 2021):
  - where: at the unit's position if the site grid has one; at the position the pooling read
    (last, first, marked, index); at every position for poolings over positions (mean, max, yours);
    per-head units at that head; head-pooled units on the concatenation of heads (concat) or on
    each head's vector (mean, sum); for a k/v unit, the key/value head the query head reads (shared
    by its group under grouped-query attention);
  - the direction is `ProbeFit.directions` (raw activation basis; with k folds, the normalised mean
    of the folds' directions).
Measured per site:
  metric_base / metric_ablated   the task metric (e.g. logit_diff) at each prompt's last token,
                                 averaged over prompts; metric_change = mean(ablated - base), with
                                 its standard error over prompts
  random_metric_change           the same for a seeded random direction of the same rank at the
                                 same site (what removing *a* direction of that size does)
  probe_<m>_ablated              the fitted probes' held-out score after their own direction is removed:
                                 each fold's probe is scored on its test rows of activations
                                 re-collected with THAT fold's direction removed (read after the
                                 change), then averaged over folds. A linear probe whose direction was
                                 removed outputs a constant, so each fold's score is that of always
                                 answering one class in its test rows (mean pooling: exactly; max: not)
  refit_<m>_ablated              a new probe fitted on the ablated activations (same split, same
                                 grid, no control): what stays linearly decodable once the direction
                                 is gone (one step of INLP, Ravfogel et al. 2020)
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from torch import Tensor

from ..config_model import ConfigModel
from ..data.tokenized import Batch
from ..errors import ConfigError
from ..metrics import Metric
from ..models.adapter import Intervention, ModelAdapter
from ..sites import absolute_positions
from .collect import MemberRead, UnitRead
from .pooling import PoolFn
from .project import project_out

ABLATABLE_HEAD_POOLINGS = ("concat", "mean", "sum")


class CausalCheck(ConfigModel):
    """Which probed sites to ablate, and the task metric to watch.

    sites:           "best" (the `top` sites with the highest selectivity; without a control, the
                     highest held-out score), "all", or a list of site labels (the table's `site`).
    top:             how many sites "best" takes.
    metric:          the task metric read at each prompt's last token (needs answers in the data).
    random_baseline: also remove a seeded random direction of the same rank at each site.
    answer_scoring:  "first_token" (default; data/tokenized.py) or "single" (each answer one token).
    """


    sites: Literal["best", "all"] | list[str] = Field(default="best", description="best (the top sites by "
                                                      "selectivity, or by held-out score without a control), all, or "
                                                      "a list of site labels")
    top: int = Field(default=1, ge=1, description="how many sites best takes")
    metric: Metric = Field(default_factory=Metric, description="the task metric at each prompt's last token (needs "
                           "answers)")
    random_baseline: bool = Field(default=True, description="also remove a seeded random direction of the same rank "
                                  "at each site")
    answer_scoring: Literal["first_token", "single"] = Field(default="first_token", description="an answer of "
        "several tokens: first_token reads its first token (one shared by a correct and a wrong answer is read for "
        "neither); single refuses it (multi_token_answer)")

    def n_sites(self, n_units: int) -> int:
        if self.sites == "best":
            return min(self.top, n_units)
        return n_units if self.sites == "all" else len(self.sites)


def check_units(model: ModelAdapter, units: list[UnitRead], chosen: list[int] | None, head_pooling: str) -> None:
    """Refuse, before any run, a unit the check cannot ablate (chosen=None: any unit may be chosen)."""
    for i in chosen if chosen is not None else range(len(units)):
        u = units[i]
        if len(u.members) != 1:
            raise ConfigError(f"site {u.label!r} reads {len(u.members)} activations together: its direction spans "
                              "several sites and cannot be removed at one place", code="causal_check_site",
                              remedy="check single sites (a layer axis in sites.over, no groups), or drop causal_check")
        m = u.members[0]
        if m.has_heads and m.head is None and head_pooling not in ABLATABLE_HEAD_POOLINGS:
            raise ConfigError(f"the causal check cannot invert head pooling {head_pooling!r}",
                              code="causal_check_site", remedy=f"use head_pooling in {ABLATABLE_HEAD_POOLINGS}")
        if m.act.kind != "result":
            model.hook_name(m.act)  # refuses what cannot be written on this model


def chosen_sites(check: CausalCheck, labels: list[str], score: np.ndarray) -> list[int]:
    """Unit indices to check: by label, all, or the `top` by score (NaN last, ties by order)."""
    if check.sites == "all":
        return list(range(len(labels)))
    if check.sites == "best":
        order = np.argsort(-np.nan_to_num(score, nan=-np.inf), kind="stable")
        return [int(i) for i in order[: check.top]]
    return [labels.index(s) for s in check.sites]


def validate_site_labels(check: CausalCheck, labels: list[str]) -> list[int] | None:
    if isinstance(check.sites, list):
        unknown = [s for s in check.sites if s not in labels]
        if unknown:
            raise ConfigError(f"causal_check.sites {unknown} are not probed sites", code="causal_check_site",
                              remedy=f"probed sites: {labels[:12]}{' ...' if len(labels) > 12 else ''}")
        return [labels.index(s) for s in check.sites]
    return list(range(len(labels))) if check.sites == "all" else None


def _project_member(v: Tensor, m: MemberRead, basis: Tensor, head_pooling: str) -> Tensor:
    """v [..., axes of the kind without pos] with the directions' span removed where the probe read."""
    if m.has_heads:
        if m.head is not None:
            v = v.clone()
            v[..., m.head, :] = project_out(v[..., m.head, :], basis)
            return v
        if head_pooling == "concat":
            flat = v.reshape(*v.shape[:-2], -1)
            return project_out(flat, basis).reshape(v.shape)
        return project_out(v, basis)  # mean / sum: each head's vector
    index = m.neuron if m.neuron is not None else m.feature  # one neuron or one dictionary feature
    if index is not None:
        v = v.clone()
        v[..., index: index + 1] = project_out(v[..., index: index + 1], basis)
        return v
    return project_out(v, basis)


def ablation(m: MemberRead, directions: Tensor, pool: PoolFn, at: Tensor | None,
             head_pooling: str) -> Callable[[Batch], list[Intervention]]:
    """Per batch: the intervention that removes span(directions [k, F]) where member m was read."""
    one_position = getattr(pool, "positions", None)

    def for_batch(b: Batch) -> list[Intervention]:
        if m.pos is not None:
            positions = absolute_positions(m.pos, b.lengths, b.roles)
        elif one_position is not None:
            positions = one_position(b.lengths, None if at is None else at[b.index])
        else:
            positions = None  # pooled over positions: ablate at every position

        def fn(x: Tensor) -> Tensor:
            if positions is None:
                return _project_member(x, m, directions, head_pooling)
            rows = torch.arange(x.shape[0], device=x.device)
            pos = positions.to(x.device)
            x = x.clone()
            x[rows, pos] = _project_member(x[rows, pos], m, directions, head_pooling)
            return x
        return [Intervention(m.act, fn)]
    return for_batch


def random_directions(like: Tensor, seed: int) -> Tensor:
    """Seeded random unit directions with the shape of `like` [k, F] (its own CPU generator)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed) * 7919 + 0xCA5A)
    r = torch.randn(like.shape, generator=g, dtype=torch.float64)
    return (r / r.norm(dim=-1, keepdim=True)).to(like.device)


def summary_row(label: str, metric_name: str, base: Tensor, ablated: Tensor, random: Tensor | None,
                rank: int) -> dict[str, Any]:
    diff = (ablated - base).double()
    n = diff.numel()
    row: dict[str, Any] = {"site": label, "metric": metric_name, "directions_removed": rank,
                           "metric_base": float(base.mean()), "metric_ablated": float(ablated.mean()),
                           "metric_change": float(diff.mean()),
                           "metric_change_se": float(diff.std(correction=1) / n**0.5) if n > 1 else float("nan")}
    if random is not None:
        rdiff = (random - base).double()
        row["random_metric_change"] = float(rdiff.mean())
        row["random_metric_change_se"] = float(rdiff.std(correction=1) / n**0.5) if n > 1 else float("nan")
    return row


def causal_intervals(per_prompt: pd.DataFrame, stats: Any, seed: int) -> pd.DataFrame:
    """Per checked site, bootstrap intervals over prompts (stats/) of metric_change = mean(ablated - base),
    random_metric_change = mean(random - base), and metric_change_vs_random = mean(ablated - random), the
    paired difference that says whether the probe's direction moves the metric more than a random one."""
    from ..stats import interval_columns, mean_stat, summarise

    rows = []
    for site, sub in per_prompt.groupby("site", sort=False):
        sub = sub.sort_values("example")
        cols = {"metric_change": sub["metric_ablated"] - sub["metric_base"]}
        if "metric_random" in sub:
            cols["random_metric_change"] = sub["metric_random"] - sub["metric_base"]
            cols["metric_change_vs_random"] = sub["metric_ablated"] - sub["metric_random"]
        names = list(cols)
        values = np.column_stack([cols[c].to_numpy(dtype=np.float64) for c in names])
        summary = summarise(mean_stat(values), stats, seed)
        row: dict[str, Any] = {"site": site}
        for j, name in enumerate(names):
            if name == "metric_change_vs_random":
                row[name] = float(summary.value[j])
            for key, col in interval_columns(summary, name, stats).items():
                if not key.endswith("_se"):  # the standard errors are the table's own columns
                    row[key] = float(np.asarray(col)[j])
        rows.append(row)
    return pd.DataFrame(rows)


def per_prompt_frame(label: str, base: Tensor, ablated: Tensor, random: Tensor | None) -> pd.DataFrame:
    frame = pd.DataFrame({"site": label, "example": np.arange(base.numel()), "metric_base": base.numpy(),
                          "metric_ablated": ablated.numpy()})
    if random is not None:
        frame["metric_random"] = random.numpy()
    return frame


def fold_testing_each(tests: list[Tensor], n: int) -> Tensor | None:
    """[n]: the fold whose test rows hold each prompt (-1: none), or None where two folds' test rows overlap."""
    fold_of = torch.full((n,), -1, dtype=torch.long)
    for f, rows in enumerate(tests):
        if (fold_of[rows] >= 0).any():
            return None
        fold_of[rows] = f
    return fold_of


def fold_ablation(m: MemberRead, fold_dirs: Tensor, fold_of: Tensor, pool: PoolFn, at: Tensor | None,
                  head_pooling: str) -> Callable[[Batch], list[Intervention]]:
    """Per batch: each prompt with its own fold's directions removed (fold_of[i]: the fold whose test rows
    hold prompt i; -1: left as it is). A prompt's row is what fold f's own ablation makes of it: every
    row of a forward is computed on its own."""
    per_fold = [ablation(m, fold_dirs[f], pool, at, head_pooling) for f in range(fold_dirs.shape[0])]

    def for_batch(b: Batch) -> list[Intervention]:
        folds = fold_of[b.index]
        edits = [(torch.nonzero(folds == f)[:, 0], per_fold[f](b)[0].fn) for f in range(len(per_fold))]

        def fn(x: Tensor) -> Tensor:
            out = x.clone()
            for rows, edit in edits:
                if rows.numel():
                    r = rows.to(x.device)
                    out[r] = edit(x)[r]
            return out
        return [Intervention(m.act, fn)]
    return for_batch


def _own_direction_scores(model: ModelAdapter, batches: list[Batch], unit: UnitRead, pool: PoolFn,
                          at: Tensor | None, head_pooling: str, n: int, fold_dirs: Tensor, fold_of: Tensor | None,
                          X_mean: Tensor, held_out: Callable[[Tensor], dict[str, Tensor]], primary: str,
                          quiet: bool) -> float:
    """Mean over folds of fold f's held-out score with fold f's own direction removed. A single fold reuses
    the ablation already collected; folds whose test rows are disjoint (k-fold) share one collection, each
    prompt ablated by the fold that tests it (fold_of); otherwise one collection per fold."""
    from .collect import collect

    if fold_dirs.shape[0] == 1:
        return float(held_out(X_mean)[primary][0].double())
    m = unit.members[0]
    if fold_of is not None:
        X = collect(model, batches, [unit], pool, at, head_pooling, n, metric=None, quiet=quiet,
                    interventions=fold_ablation(m, fold_dirs, fold_of, pool, at, head_pooling),
                    desc=f"ablate {unit.label} (each fold's own)").features(0)
        return float(held_out(X)[primary].double().mean())
    scores = []
    for f in range(fold_dirs.shape[0]):
        Xf = collect(model, batches, [unit], pool, at, head_pooling, n, metric=None, quiet=quiet,
                     interventions=ablation(m, fold_dirs[f], pool, at, head_pooling),
                     desc=f"ablate {unit.label} (fold {f})").features(0)
        scores.append(float(held_out(Xf)[primary][f].double()))
    return float(np.mean(scores))


def run_causal_check(model: ModelAdapter, batches: list[Batch], units: list[UnitRead], chosen: list[int],
                     pool: PoolFn, at: Tensor | None, head_pooling: str, n: int, *,
                     directions_of: Callable[[int], Tensor], fold_directions_of: Callable[[int], Tensor],
                     held_out: Callable[[int, Tensor], dict[str, Tensor]],
                     refit: Callable[[int, Tensor], dict[str, Tensor]], primary: str, check: CausalCheck,
                     metric_fn: Callable[..., Tensor], metric_base: Tensor, seed: int,
                     fold_of: Tensor | None = None, quiet: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Ablate each chosen unit's directions (and a random baseline); returns (summary per site, per prompt).

    directions_of(u) -> [k, F] the unit's probe directions (the ablation of the metric check);
    fold_directions_of(u) -> [folds, k, F] each fold's own; held_out(u, X [N, F]) and refit(u, X) ->
    metric -> [folds] scores of the fitted probes / of a new probe on re-collected activations; fold_of
    (`fold_testing_each`): the fold testing each prompt, where the folds' test rows are disjoint (one collection
    for every fold's own direction), else None (one collection per fold).
    """
    from .collect import collect

    rows, frames = [], []
    for u in chosen:
        unit = units[u]
        m = unit.members[0]
        dirs = directions_of(u)
        ablated = collect(model, batches, [unit], pool, at, head_pooling, n, metric=metric_fn, quiet=quiet,
                          interventions=ablation(m, dirs, pool, at, head_pooling), desc=f"ablate {unit.label}")
        assert ablated.metric is not None
        random_metric = None
        if check.random_baseline:
            rnd = collect(model, batches, [unit], pool, at, head_pooling, n, metric=metric_fn, quiet=quiet,
                          interventions=ablation(m, random_directions(dirs, seed + u), pool, at, head_pooling),
                          desc=f"random {unit.label}")
            random_metric = rnd.metric
        row = summary_row(unit.label, check.metric.type, metric_base, ablated.metric, random_metric,
                          int(torch.linalg.matrix_rank(dirs.double())))
        X = ablated.features(0)
        row[f"probe_{primary}_ablated"] = _own_direction_scores(
            model, batches, unit, pool, at, head_pooling, n, fold_directions_of(u), fold_of, X,
            lambda Xf: held_out(u, Xf), primary, quiet)
        row[f"refit_{primary}_ablated"] = float(refit(u, X)[primary].double().mean())
        rows.append(row)
        frames.append(per_prompt_frame(unit.label, metric_base, ablated.metric, random_metric))
    return pd.DataFrame(rows), pd.concat(frames, ignore_index=True)
