"""The operations the GPU script runs, how each table's rows are keyed, which columns are compared, and the
tolerance of each (operation, dtype) against the same run on the CPU in float32.

The measure compared with a tolerance is the largest difference of a column, relative to that column's
scale on the reference run:

    err = max over rows r and compared columns c of |x[r, c] - ref[r, c]| / max over rows |ref[., c]|

Rows are joined by the operation's own key columns (site, layer, position; edge; component; ...), never by
their order. A row present on one side only is a failure. docs/scale.md lists the same tolerances.

Why these numbers: float32 on another device differs only by the order of reductions (cuBLAS, SDPA kernels;
TF32 is switched off by the script), ~1e-6 relative per matmul, so 1e-3 leaves room for 30 layers and still
catches a real fault (a tensor left on the wrong device, a dtype cast in the wrong place: errors of order 1).
bfloat16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4%); through a few layers the logits move by a few
per cent of their range, and a quantity that is a difference of two nearby runs (a patched minus a clean
metric, an edge score) by more. The bfloat16 tolerances are ~3x the largest error measured on the CPU
(demo model, 8 prompts; SmolLM2, 8 prompts, six of the operations): docs/scale.md has the measurements.
A column that is a difference of two metrics (steering's effect and its margin over the random direction)
is measured on the scale of the metric itself (Case.scales): its own scale can be near 0 while bfloat16
moves each metric by a step of the metric's size. The circuits' faithfulness, CPR and CMD are fractions
of the clean - corrupt gap, measured on a scale of at least 1 (FRACTIONS).
Probing compares test accuracy and AUROC: one prompt more or less classified right moves the accuracy by
1/n, so its tolerance is absolute-like (the column's scale is ~1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

STATS = {"n_boot": 200}  # intervals are not compared; a few resamples keep the runs short


@dataclass(frozen=True)
class Case:
    """One operation of the script.

    build:    (ctx) -> (operation, data); ctx.model_name, ctx.tokenizer, ctx.n, ctx.translators, ...
    keys:     the table columns that name a row (joined on these).
    columns:  the columns compared.
    tol:      dtype -> tolerance on err (above).
    extra:    (result) -> {part name: (frame, keys, columns)}: further tables compared with the same tolerance
              (the circuits' summary and faithfulness curve; ACDC's decisions).
    models:   the models it runs on ("demo", "smollm2").
    """

    name: str
    build: Callable[[Any], tuple[Any, Any]]
    keys: tuple[str, ...]
    columns: tuple[str, ...]
    tol: dict[str, float]
    extra: Callable[[Any], dict[str, tuple[pd.DataFrame, tuple[str, ...], tuple[str, ...]]]] | None = None
    models: tuple[str, ...] = ("demo", "smollm2")
    table: bool = True  # compare result.table (False: only the extra parts)
    rows: Callable[[pd.DataFrame], pd.DataFrame] | None = None  # the rows compared (default: all)
    same_rows: bool = True  # False: rows kept where a feature is active may differ (noted, not a failure)
    scales: dict[str, str | float] = field(default_factory=dict)  # column -> the column whose scale measures
    # it, or the least scale it is measured on (fractions of a gap: faithfulness, CPR, CMD on a scale of 1)


def _es() -> Any:
    import entoscope as es

    return es


def ioi(ctx: Any, n: int | None = None, seed: int = 1) -> Any:
    return _es().tasks.ioi(n=n or ctx.n, seed=seed, tokenizer=ctx.tokenizer)


def _positions(ctx: Any) -> Any:
    """Every position on the demo; on a real model (slow on a CPU) the subject's second mention and the end."""
    return "all" if ctx.model_name == "demo" else ["S2", "END"]


def _circuit_parts(result: Any) -> dict[str, tuple[pd.DataFrame, tuple[str, ...], tuple[str, ...]]]:
    s = result.extra["summary"]
    names = [k for k in ("m_full", "m_empty", "m_circuit", "faithfulness", "cpr", "cmd") if k in s]
    parts = {"summary": (pd.DataFrame([{"part": "summary", **{k: s[k] for k in names}}]), ("part",), tuple(names))}
    # faithfulness, CPR and CMD are fractions of the clean - corrupt gap: measured on a scale of at least 1
    # (CMD is a distance from 1, so near 0 for a good circuit)
    curve = result.extra.get("curve")
    if curve is not None:
        parts["curve"] = (curve, ("fraction",), ("faithfulness",))
    return parts


def _acdc_parts(result: Any) -> dict[str, tuple[pd.DataFrame, tuple[str, ...], tuple[str, ...]]]:
    """ACDC's decisions: the damages of the steps both runs took alike (a search whose paths part after a
    decision near the threshold compares only up to there: ACDC_PREFIX)."""
    return {"decisions": (result.extra["decisions"], ("step", "edge"), ("damage",))}


def _interchange(ctx: Any) -> tuple[Any, Any]:
    """DAS and a fixed basis (PCA of the pairs' differences) with their placebos and the whole vector, rank 4,
    3 epochs, at 2 layers x 2 roles of IOI (variable io), on 16 prompts (32 pairs, 16 held out). IIA is a
    count over the held-out pairs: one pair moves it by 1/16 = 0.0625 (the tolerances below)."""
    es = _es()
    layers = [0, 2] if ctx.model_name == "demo" else [8, 24]
    op = es.Interchange(layers=layers, positions=["S2", "END"], bases=["das", "pca"], rank=4, epochs=3, seed=0,
                        stats=STATS)
    return op, ioi(ctx, n=16)


class SkipCase(Exception):
    """The case cannot run here; its message is the one line the script prints."""


def _feature_sites(ctx: Any, method: str, features: Any) -> tuple[Any, Any]:
    es = _es()
    if ctx.model_name != "demo":
        raise SkipCase("the demo's SAEs read the demo model's activations only")
    sites = es.Sites(activation="resid_post", dictionary="demo/resid_post.1", over=["feature"], features=features)
    return es.Patching(method=method, sites=sites, stats=STATS), ioi(ctx)


def _feature_nodes(frame: pd.DataFrame) -> pd.DataFrame:
    """The feature graph's nodes but its error nodes: an error node is the activation minus the dictionary's
    reconstruction, a small difference of two large numbers that bfloat16 rounds by a step of the large ones
    (on the demo model its attribution moved by 0.40 of a 1.27 scale: reported in docs/scale.md)."""
    return frame[frame["kind"].astype(str) != "error"]


def _demo_only(ctx: Any, op: Any) -> Any:
    if ctx.model_name != "demo":
        raise SkipCase("the demo's dictionaries read the demo model's activations only")
    return op


F32 = 1e-3
PATCH_KEYS = ("site", "layer", "position")


def cases() -> list[Case]:
    es = _es()
    resid = lambda: es.Sites(activation="resid_post", over=["layer"])  # noqa: E731
    lens_cols = ("kl_mean", "target_prob_mean", "target_logit_mean")
    return [
        Case("lens.logit", lambda c: (es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"],
                                                             positions=_positions(c)), stats=STATS), ioi(c)),
             ("site", "layer", "position"), lens_cols, {"float32": F32, "bfloat16": 0.06}),
        Case("lens.tuned", lambda c: (es.Lens(method="tuned", translators=c.translators, sites=resid(), stats=STATS),
                                      ioi(c)),
             ("site", "layer", "position"), lens_cols, {"float32": F32, "bfloat16": 0.06}),
        Case("probing", lambda c: (es.Probing(sites=resid(), split="kfold", k=3, C_grid=[1.0], stats=STATS),
                                   ioi(c, n=max(c.n, 24))),
             ("site", "layer"), ("test_accuracy", "test_auroc"), {"float32": 0.05, "bfloat16": 0.2}),
        Case("patching.exact", lambda c: (es.Patching(method="exact", sites=es.Sites(
            activation="resid_pre", over=["layer", "position"], positions=_positions(c)), stats=STATS), ioi(c)),
             PATCH_KEYS, ("value", "patched_mean"), {"float32": F32, "bfloat16": 0.1}),
        Case("patching.attribution", lambda c: (es.Patching(method="attribution", sites=es.Sites(
            activation="z", over=["layer", "head"]), stats=STATS), ioi(c)),
             ("site", "layer", "head"), ("value",), {"float32": F32, "bfloat16": 0.1}),
        Case("patching.integrated_gradients", lambda c: (es.Patching(method="integrated_gradients", ig_steps=3,
                                                                     sites=es.Sites(activation="attn_out",
                                                                                    over=["layer"]),
                                                                     stats=STATS), ioi(c)),
             ("site", "layer"), ("value",), {"float32": F32, "bfloat16": 0.1}),
        Case("dla", lambda c: (es.DirectLogitAttribution(stats=STATS), ioi(c)),
             ("component", "kind", "layer", "head", "neuron"), ("mean",), {"float32": F32, "bfloat16": 0.06}),
        Case("head_scores", lambda c: (es.HeadScores(stats=STATS), es.tasks.repeated_tokens(
            n=c.n, seed=1, vocab_size=c.vocab_size, length=10, bos_token_id=c.bos)),
             ("kind", "layer", "head", "site"), ("score",), {"float32": F32, "bfloat16": 0.06}),
        Case("ifr", lambda c: (es.InformationFlowRoutes(stats=STATS), ioi(c)),
             ("component", "kind", "layer", "head"), ("importance_mean", "last_position_importance_mean"),
             {"float32": F32, "bfloat16": 0.1}),
        Case("circuits.eap", lambda c: (es.Circuits(method="eap", n_edges=20, faithfulness=[0.01, 0.1, 0.5],
                                                    stats=STATS), ioi(c)),
             ("edge",), ("score",), {"float32": F32, "bfloat16": 0.15}, extra=_circuit_parts),
        Case("circuits.eap_ig", lambda c: (es.Circuits(method="eap_ig", steps=3, n_edges=20,
                                                       faithfulness=[0.01, 0.1, 0.5], stats=STATS), ioi(c)),
             ("edge",), ("score",), {"float32": F32, "bfloat16": 0.15}, extra=_circuit_parts),
        Case("circuits.acdc", lambda c: (es.Circuits(method="acdc", acdc_threshold=0.05, max_forward_passes=24,
                                                     faithfulness=[], stats=STATS), ioi(c, n=min(c.n, 8))),
             ("edge",), (), {"float32": F32, "bfloat16": 0.15}, extra=_acdc_parts, table=False),
        Case("features.attribution", lambda c: _feature_sites(c, "attribution", "all"),
             ("site", "feature"), ("value",), {"float32": F32, "bfloat16": 0.15}),
        Case("features.exact", lambda c: _feature_sites(c, "exact", "0:16"),
             ("site", "feature"), ("value",), {"float32": F32, "bfloat16": 0.15}),
        Case("parameter_lens", lambda c: (es.ParameterLens(neurons="0:8", top_k=3), None),
             ("target", "space", "layer", "neuron"), ("norm", "top1_score"), {"float32": F32, "bfloat16": 0.03}),
        Case("decoder_lens", lambda c: (_demo_only(c, es.DecoderLens(dictionary="demo/transcoder.1", features="0:16",
                                                                    top_k=3)), None),
             ("target", "space", "dictionary", "feature"), ("norm", "top1_score"), {"float32": F32, "bfloat16": 0.03}),
        Case("feature_dla", lambda c: (_demo_only(c, es.FeatureDLA(dictionary="demo", activation="mlp_out",
                                                                  top_k_features=4, stats=STATS)), ioi(c)),
             ("component", "kind", "layer", "head", "dictionary", "feature"), ("mean",),
             {"float32": F32, "bfloat16": 0.1}, same_rows=False),
        Case("feature_graph", lambda c: (_demo_only(c, es.FeatureGraph(dictionary="demo", activation="resid_post",
                                                                      max_features=4)), ioi(c, n=min(c.n, 8))),
             ("node", "kind", "site", "layer", "dictionary", "feature"), ("attribution",),
             {"float32": F32, "bfloat16": 0.15}, same_rows=False, rows=_feature_nodes),
        Case("steering", lambda c: (es.Steering(direction={"source": "mean_difference", "site": "resid_pre.1",
                                                           "data": {"task": "ioi", "n": c.n, "seed": 2}},
                                                coefficients=[0.5, 1.0], side_effects=None, stats=STATS), ioi(c)),
             ("condition", "direction", "coefficient", "mode", "site", "metric"),
             ("metric_steered", "effect", "minus_random"), {"float32": F32, "bfloat16": 0.1},
             scales={"effect": "metric_steered", "minus_random": "metric_steered"}),
        # IIA over 16 held-out pairs, measured identical in bfloat16 and float32 on the CPU (demo, 3 data seeds;
        # SmolLM2, 1 seed; every row): a tolerance of one pair in float32 (DAS trained with reductions in another order may
        # flip a pair at the boundary), two pairs in bfloat16
        Case("interchange", _interchange, ("site", "basis"), ("iia",), {"float32": 0.07, "bfloat16": 0.15}),
    ]


# ---------------------------------------------------------------------------------------------- comparing
@dataclass
class Diff:
    """The worst relative difference of one comparison, with where it is."""

    err: float = 0.0
    abs_diff: float = 0.0
    scale: float = 0.0
    where: str = ""
    problems: list[str] = field(default_factory=list)  # rows missing on one side, NaN on one side only
    notes: list[str] = field(default_factory=list)  # what is reported without failing

    def take(self, other: Diff) -> None:
        if other.err > self.err or not self.where:
            self.err, self.abs_diff, self.scale, self.where = other.err, other.abs_diff, other.scale, other.where
        self.problems += other.problems
        self.notes += other.notes


def _key_frame(frame: pd.DataFrame, keys: tuple[str, ...]) -> pd.DataFrame:
    out = frame.copy()
    for k in keys:
        out[k] = out[k].astype(str)  # NaN heads, integer or label positions: joined as written
    return out


def compare_frames(ref: pd.DataFrame, got: pd.DataFrame, keys: tuple[str, ...], columns: tuple[str, ...],
                   part: str, scales: dict[str, str | float] | None = None, same_rows: bool = True) -> Diff:
    """err (module docstring) of `columns` between two tables joined on `keys`."""
    keys = tuple(k for k in keys if k in ref.columns)
    diff = Diff()
    a, b = _key_frame(ref, keys), _key_frame(got, keys)
    if a.duplicated(list(keys)).any():
        diff.problems.append(f"{part}: keys {list(keys)} do not name rows uniquely")
        return diff
    joined = a.merge(b, on=list(keys), how="outer", suffixes=("_ref", "_run"), indicator=True)
    lost = joined[joined["_merge"] != "both"]
    if len(lost):
        row = lost.iloc[0]
        (diff.problems if same_rows else diff.notes).append(
            f"{part}: {len(lost)} of {len(joined)} rows on one side only (first: "
            f"{', '.join(f'{k}={row[k]}' for k in keys)}, {row['_merge']})")
    both = joined[joined["_merge"] == "both"]
    for col in columns:
        x = both[f"{col}_ref"].to_numpy(dtype=np.float64)
        y = both[f"{col}_run"].to_numpy(dtype=np.float64)
        nan = np.isnan(x) != np.isnan(y)
        if nan.any():
            diff.problems.append(f"{part}.{col}: NaN on one side only in {int(nan.sum())} rows")
        ok = ~(np.isnan(x) | np.isnan(y))
        if not ok.any():
            continue
        on = (scales or {}).get(col)  # a difference of two metrics is measured on the metrics' scale
        if isinstance(on, str):
            scale = float(np.nanmax(np.abs(both[f"{on}_ref"].to_numpy(dtype=np.float64))))
        else:
            scale = max(float(np.abs(x[ok]).max()), float(on or 0.0))
        d = np.abs(x - y)
        d[~ok] = 0.0
        i = int(np.argmax(d))
        err = float(d[i]) / scale if scale > 0 else float(d[i])
        where = f"{part}.{col} at " + ", ".join(f"{k}={both.iloc[i][k]}" for k in keys)
        diff.take(Diff(err, float(d[i]), scale, where))
    return diff


ACDC_PREFIX = "decisions"
FRACTIONS = {"faithfulness": 1.0, "cpr": 1.0, "cmd": 1.0}  # the circuits' summary and curve (see _circuit_parts)


def compare_results(case: Case, ref: Any, got: Any) -> Diff:
    """The case's table and extra parts, run vs reference."""
    total = Diff()
    if case.table:
        pick = case.rows or (lambda f: f)
        total.take(compare_frames(pick(ref.table), pick(got.table), case.keys, case.columns, "table", case.scales,
                                  case.same_rows))
    if case.extra is not None:
        mine, theirs = case.extra(ref), case.extra(got)
        for part, (frame, keys, cols) in mine.items():
            other = theirs[part][0]
            if part == ACDC_PREFIX:  # the steps both searches took alike: up to the first other decision
                frame, other, note = _common_prefix(frame, other)
                if note:
                    total.where = total.where or note
            total.take(compare_frames(frame, other, keys, cols, part, FRACTIONS))
    return total


def _common_prefix(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    n = min(len(a), len(b))
    edge = a["edge"].iloc[:n].to_numpy() == b["edge"].iloc[:n].to_numpy()
    same = edge & (a["decision"].iloc[:n].to_numpy() == b["decision"].iloc[:n].to_numpy())
    k = n if same.all() else int(np.argmin(same))
    if k < n and edge[k]:  # the step whose decision differs tried the same edge on the same circuit: compared
        k += 1
    note = "" if k == n and len(a) == len(b) else f"decisions part at step {k - 1} of {len(a)}"
    return a.iloc[:k], b.iloc[:k], note
