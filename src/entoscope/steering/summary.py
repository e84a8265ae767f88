"""The steering table: one row per (direction or random baseline, coefficient), each number a mean over prompts
with its bootstrap interval (stats/), read from the merged per-prompt columns block by block.

    condition          the row's name: 'direction c=<c>' or 'random c=<c>' (figures and takeaways name rows by it)
    direction_norm     |v| of the direction steered with (its random baseline has the same norm)
    metric_steered     mean task metric under steering (task prompts)
    metric_unsteered   mean task metric without (the same on every row)
    effect             mean over task prompts of (steered - unsteered)
    minus_random       direction rows: mean over task prompts of (direction - random baseline) at the same
                       coefficient; NaN on the random rows
    kl                 mean over held-out prompts of KL(steered || unsteered), averaged over positions (nats)
    loss_change        mean over held-out prompts of (steered - unsteered) next-token loss (nats)
    <task>_change      mean over that built-in task's prompts of (steered - unsteered) score
    excludes_0         the effect's interval excludes 0
    beats_random       direction rows: the effect's interval excludes 0, and so does minus_random's, on the
                       effect's side (docs/steering.md)
    material           the effect's interval lies wholly beyond NEGLIGIBLE (5%) of |metric_unsteered|, on one side
    negligible         the effect's interval lies wholly within NEGLIGIBLE of |metric_unsteered| (docs/pages.md)
    negligible_share   NEGLIGIBLE, the band's share of |metric_unsteered| (the same on every row)
The operation adds `units`, `written_norm` (|c| times what a coefficient multiplies) and, with units
residual_norm, `residual_norm` (R).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from ..executors.columns import PromptColumns
from ..stats import Stats, interval_columns, streamed_mean, summarise
from .rows import SCORE, TASK, RowSet

Reader = Callable[[int, int], np.ndarray]
NEGLIGIBLE = 0.05  # an effect within 5% of the unsteered metric's size is negligible (docs/pages.md)


def _mean(n: int, cells: int, read: Reader, stats: Stats, seed: int) -> Any:
    return summarise(streamed_mean(n, cells, read), stats, seed)


def _reader(columns: PromptColumns, key: str, lo: int, fn: Callable[[np.ndarray], np.ndarray]) -> Reader:
    return lambda a, b: fn(columns.read(lo + a, lo + b, [key])[key])


def steering_table(columns: PromptColumns, sets: list[RowSet], coefficients: list[float], info: dict[str, Any],
                   stats: Stats, seed: int) -> pd.DataFrame:
    """The table (see the module docstring); `info` holds the columns every row repeats (mode, site, metric)."""
    K = len(coefficients)
    task = next(s for s in sets if s.name == TASK)
    held = [s for s in sets if s.held_out]
    rows = 2 * K
    cols: dict[str, Any] = {"condition": [f"{d} c={c:g}" for d in ("direction", "random") for c in coefficients],
                            "direction": ["direction"] * K + ["random"] * K, "coefficient": list(coefficients) * 2}
    cols.update({k: [v] * rows for k, v in info.items()})

    def put(name: str, summary: Any, cells: slice = slice(None), test: bool = False) -> None:
        values = np.full(rows, np.nan)
        values[cells] = summary.value
        cols[name] = values
        for key, arr in interval_columns(summary, name, stats, test=False).items():
            full = np.full(rows, np.nan)
            full[cells] = arr
            cols[key] = full
        if test:
            full = np.full(rows, np.nan)
            full[cells] = summary.p_value
            cols[f"{name}_p"] = full

    n = task.n
    put("metric_steered", _mean(n, rows, _reader(columns, "metric", task.lo, lambda m: m[:, 1:]), stats, seed))
    unsteered = _mean(n, 1, _reader(columns, "metric", task.lo, lambda m: m[:, :1]), stats, seed)
    cols["metric_unsteered"] = np.repeat(unsteered.value, rows)
    cols["metric_unsteered_ci_low"] = np.repeat(unsteered.ci_low, rows)
    cols["metric_unsteered_ci_high"] = np.repeat(unsteered.ci_high, rows)
    put("effect", _mean(n, rows, _reader(columns, "metric", task.lo, lambda m: m[:, 1:] - m[:, :1]), stats, seed),
        test=True)
    put("minus_random", _mean(n, K, _reader(columns, "metric", task.lo, lambda m: m[:, 1:K + 1] - m[:, K + 1:]),
                              stats, seed), slice(0, K))
    if held:
        lo, hi = held[0].lo, held[-1].hi  # the held-out sets are contiguous (rows.py)
        put("kl", _mean(hi - lo, rows, _reader(columns, "kl", lo, lambda m: m[:, 1:]), stats, seed))
        put("loss_change", _mean(hi - lo, rows, _reader(columns, "loss", lo, lambda m: m[:, 1:] - m[:, :1]),
                                 stats, seed))
        for s in held:
            if s.name.startswith(SCORE):
                put(f"{s.name[len(SCORE):]}_change",
                    _mean(s.n, rows, _reader(columns, "metric", s.lo, lambda m: m[:, 1:] - m[:, :1]), stats, seed))
    cols["n_prompts"] = [n] * rows
    cols["n_held_out"] = [sum(s.n for s in held)] * rows
    cols["ci_level"] = [stats.ci_level] * rows
    table = pd.DataFrame(cols)
    table["excludes_0"] = _excludes_zero(table, "effect")
    table["beats_random"] = beats_random(table)
    table["negligible_share"] = NEGLIGIBLE
    table["material"], table["negligible"] = materiality(table)
    return table


def materiality(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(material, negligible) per row: the effect's interval lies wholly beyond / wholly within NEGLIGIBLE times
    |metric_unsteered| (the band around 0 an effect too small to matter stays in)."""
    band = table["negligible_share"].to_numpy(float) * np.abs(table["metric_unsteered"].to_numpy(float))
    low, high = table["effect_ci_low"].to_numpy(float), table["effect_ci_high"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        return (low > band) | (high < -band), (low > -band) & (high < band)


def _excludes_zero(table: pd.DataFrame, name: str) -> np.ndarray:
    low, high = table[f"{name}_ci_low"].to_numpy(float), table[f"{name}_ci_high"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        return (low > 0) | (high < 0)


def beats_random(table: pd.DataFrame) -> np.ndarray:
    """Direction rows whose effect interval excludes 0 and whose (direction - random) interval excludes 0 on the
    same side as the effect (the rule of docs/steering.md); False on random rows."""
    effect = table["effect"].to_numpy(float)
    low, high = table["minus_random_ci_low"].to_numpy(float), table["minus_random_ci_high"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        same_side = np.where(effect > 0, low > 0, high < 0)
    return (table["direction"].to_numpy() == "direction") & _excludes_zero(table, "effect") & same_side


def smallest_effective(table: pd.DataFrame, column: str = "excludes_0") -> Any:
    """The direction row of smallest |coefficient| whose effect interval excludes 0 (`column` "material": lies
    beyond the negligible band) (ties: the first listed), or None."""
    rows = table[(table["direction"] == "direction") & table[column].astype(bool)]
    if not len(rows):
        return None
    order = np.argsort(np.abs(rows["coefficient"].to_numpy(float)), kind="stable")
    return rows.iloc[int(order[0])]


def prompt_rows(columns: PromptColumns, sets: list[RowSet], coefficients: list[float], lo: int,
                hi: int) -> pd.DataFrame:
    """The per-prompt table of rows lo..hi-1: one line per steered prompt and condition (direction rows: none)."""
    K = len(coefficients)
    block = columns.read(lo, hi, ["metric", "kl", "loss"])
    frames = []
    for s in sets:
        a, b = max(lo, s.lo), min(hi, s.hi)
        if a >= b or not s.steered:
            continue
        m, kl, loss = (block[k][a - lo:b - lo] for k in ("metric", "kl", "loss"))
        n = b - a
        frames.append(pd.DataFrame({
            "set": s.name, "example": np.repeat(np.arange(a - s.lo, b - s.lo), 2 * K),
            "row": np.repeat(np.arange(a, b), 2 * K),
            "direction": np.tile(["direction"] * K + ["random"] * K, n),
            "coefficient": np.tile(list(coefficients) * 2, n),
            "metric": m[:, 1:].reshape(-1), "metric_unsteered": np.repeat(m[:, 0], 2 * K),
            "effect": (m[:, 1:] - m[:, :1]).reshape(-1), "kl": kl[:, 1:].reshape(-1),
            "loss_change": (loss[:, 1:] - loss[:, :1]).reshape(-1)}))
    if not frames:
        return pd.DataFrame(columns=["set", "example", "row", "direction", "coefficient", "metric", "metric_unsteered",
                                     "effect", "kl", "loss_change"])
    return pd.concat(frames, ignore_index=True)
