"""Table columns and hover text from a Summary, in the naming every operation shares.

`<name>_ci_low`, `<name>_ci_high` (and `_se`; with `test=True` also `_p`: the inversion of the
interval against 0, `_p_bound`: whether `_p` is the resampling's resolution rather than the value,
`_q`: Benjamini-Hochberg over the table's cells, and `significant` = q <= `stats.fdr`), plus one
`ci_level` column. `p_text` writes a p-value as a reader should read it ("p = 0.012", "p < 0.0095",
"p <= 3.1e-05" at the sign-flip test's limit 2^-(n-1)),
`readable_p` a table's p columns so (what pages show).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .bootstrap import Summary
from .config import Stats
from .fdr import benjamini_hochberg


def interval_columns(summary: Summary, name: str, stats: Stats, *, test: bool = False,
                     influence: bool = False) -> dict[str, Any]:
    """The interval columns of one summarised quantity (the value itself is not repeated)."""
    cols: dict[str, Any] = {f"{name}_ci_low": summary.ci_low, f"{name}_ci_high": summary.ci_high,
                            f"{name}_se": summary.se}
    if influence:
        cols[f"{name}_influence"] = summary.influence
        cols[f"{name}_influential_prompt"] = summary.influential
    if test:
        cols.update(significance_columns(summary, name, stats))
    return cols


def significance_columns(summary: Summary, name: str, stats: Stats) -> dict[str, Any]:
    """`<name>_p`, `<name>_p_bound`, `<name>_q` (Benjamini-Hochberg over the cells) and `significant`."""
    q = benjamini_hochberg(summary.p_value)
    return {f"{name}_p": summary.p_value, f"{name}_p_bound": summary.bound(), f"{name}_q": q,
            "significant": np.where(np.isfinite(q), q <= stats.fdr, False)}


def readable_p(frame: Any) -> Any:
    """A copy of a table for reading: each `<name>_p` column as text ("0.012", "< 0.0095" where
    `<name>_p_bound`, "<= 3.1e-05" where p is the sign-flip test's limit on the row's prompts, `at_limit`),
    the `_p_bound` columns dropped (table.csv keeps both as numbers). The row's prompts: `n_prompts`
    (a confirmation table's `screen_...` columns: `screen_n_prompts`)."""
    bounds = [c for c in frame.columns if c.endswith("_p_bound") and c[: -len("_bound")] in frame]
    if not bounds:
        return frame
    out = frame.drop(columns=bounds)
    for c in bounds:
        p, b = frame[c[: -len("_bound")]], frame[c]
        n_col = "screen_n_prompts" if c.startswith("screen_") and "screen_n_prompts" in frame else "n_prompts"
        limit = at_limit(p, frame[n_col]) if n_col in frame else np.zeros(len(frame), dtype=bool)
        out[c[: -len("_bound")]] = [p_text(v, bool(k), name="", limit=bool(x)) or np.nan for v, k, x in zip(p, b, limit)]
    return out


def at_limit(p: Any, n: Any) -> np.ndarray:
    """Per row: whether p is the sign-flip test's smallest p on its n prompts, 2^-(n-1) (stats/signflip.py):
    the data's pattern is the most extreme one, and more prompts could give a smaller p."""
    p, n = np.asarray(p, dtype=float), np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", over="ignore"):
        return (n >= 2) & np.isfinite(p) & np.isclose(p, 2.0 ** -(n - 1), rtol=1e-9, atol=0)


def p_text(p: float, bound: bool = False, *, name: str = "p", limit: bool = False) -> str:
    """'p = 0.012'; 'p < 0.0095' where the p-value is the resampling's resolution (bound); 'p <= 3.1e-05' where
    it is the sign-flip test's limit on the prompts (2^-(n-1): no test on them goes lower); '' for NaN."""
    if p is None or not np.isfinite(p):
        return ""
    prefix = f"{name} " if name else ""
    if bound:
        return f"{prefix}< {p:.2g}"
    if limit:
        return f"{prefix}<= {p:.2g}"
    return f"{prefix}= {p:.2g}" if name else f"{p:.2g}"


def ci_text(row: Any, name: str) -> str:
    """'95% CI [a, b]' for a table row with `<name>_ci_low/high` and `ci_level`; '' when there is none."""
    low, high = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return ""
    return f"{round(100 * float(row['ci_level']))}% CI [{low:.3g}, {high:.3g}]"


def value_with_ci(row: Any, name: str, fmt: str = ".2f") -> str:
    """'value [low, high]' for a table row or summary dict with `<name>_ci_low/high`; the value alone
    where there is no finite interval."""
    low, high = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
    text = format(row[name], fmt)
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return text
    return f"{text} [{format(low, fmt)}, {format(high, fmt)}]"


def error_arrays(frame: Any, name: str, value: str | None = None) -> dict[str, Any] | None:
    """Plotly asymmetric error bars (value - ci_low, ci_high - value) for `frame`, or None without intervals."""
    low, high = frame.get(f"{name}_ci_low"), frame.get(f"{name}_ci_high")
    if low is None or high is None or not np.isfinite(np.asarray(low, dtype=float)).any():
        return None
    v = np.asarray(frame[value or name], dtype=float)
    return {"type": "data", "symmetric": False, "visible": True,
            "array": np.nan_to_num(np.asarray(high, dtype=float) - v),
            "arrayminus": np.nan_to_num(v - np.asarray(low, dtype=float))}


def interval_bars(frame: Any, name: str, key: str, *, axis: str = "y", table: str = "table.csv") -> dict[str, Any]:
    """Trace arguments drawing `frame`'s interval of `name` as error bars on `axis` ({} without intervals):
    the error arrays, the rows' ids (`key` column) as customdata, and meta naming the table and column
    they come from (so a reader of the page, or a test, can match every bar with its row)."""
    errors = error_arrays(frame, name)
    if errors is None:
        return {}
    return {f"error_{axis}": errors, "customdata": [str(v) for v in frame[key]],
            "meta": {"interval_of": name, f"interval_of_{axis}": name, "table": table, "key": key}}


def both_interval_bars(frame: Any, x: str, y: str, key: str, table: str = "table.csv") -> dict[str, Any]:
    """Error bars on both axes (x's interval of column `x`, y's of `y`), as `interval_bars`."""
    bx, by = interval_bars(frame, x, key, axis="x", table=table), interval_bars(frame, y, key, axis="y", table=table)
    if not bx or not by:
        return bx or by
    return {**bx, **by, "meta": {**bx["meta"], **by["meta"]}}


def level_text(level: Any) -> str:
    """'95%' for a level 0.95 (or a table with a ci_level column)."""
    if hasattr(level, "get") and not isinstance(level, (int, float)):
        column = level.get("ci_level")
        level = 0.95 if column is None or not len(column) else float(np.asarray(column, dtype=float)[0])
    return f"{round(100 * float(level))}%"


def hover_value(row: Any, name: str, fmt: str = ".3g") -> str:
    """One hover line: '<name> <value> (95% CI [low, high])', the table's column name and its cells; the
    value alone where there is no finite interval."""
    ci = ci_text(row, name)
    return f"{name} {format(float(row[name]), fmt)}" + (f" ({ci})" if ci else "")
