"""Confirmation on held-out prompts: screen every cell on one set of prompts, re-test the top k on fresh ones.

The design researchers use at scale (docs/statistics.md, "Confirmation"): a grid of m cells needs a p near
fdr / m for a discovery, but the k cells the screen ranks first, tested again on prompts the screen never
saw, need only fdr / k: the confirmation's p-values are independent of the selection, so Benjamini-Hochberg
over the k of them controls the false discovery rate among the confirmed cells. The fresh prompts come from
the same task generator with another seed (a task spec, or a Dataset a built-in task made, which carries how
it was made); data that cannot make fresh prompts (a user's file, a list of prompts, a Dataset of one's own)
is refused before the run (`confirm_needs_task`). The fresh prompts are held out for real: none is one of the
screen's prompts and none repeats (`fresh_prompts`: the generator is asked for more until n distinct new ones
are found); a task that cannot make n of them (facts has 32 countries x 4 templates) gives what it can, said
in a warning (`confirm_fresh_capped`) and in the note's count, and fewer than 2 is refused
(`confirm_no_fresh`). Without p-values (`stats.n_boot: 0`) there is nothing to confirm (`confirm_no_test`).
`plan()` counts the confirmation's passes (Operation.plan).

`Confirm` is a field of every operation (YAML `confirm: {k: 10, n: 32}`, CLI `--confirm "{k: 10}"`,
Python `confirm={"k": 10}`); only operations whose table tests its rows against 0 take it (patching, DLA,
circuits' edges, feature DLA, head scores: their excess over chance), others refuse it (`confirm_unsupported`). An operation may confirm only
the chosen cells (`Operation.confirm_subset`: patching's sites as coordinates); otherwise the whole grid
runs again on the fresh prompts and its top-k rows are read. The confirmation run goes through the same
executor (Ray: a second run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from pydantic import Field

from .config_model import ConfigModel
from .data.examples import Dataset
from .data.loading import load_data
from .errors import ConfigError, DataError, warn
from .stats import benjamini_hochberg

SEED_STEP = 1_000_003  # the fresh prompts' seed: the screen's seed plus this (a prime far from small seeds)
KEYS = ("site", "component", "edge", "node")


class Confirm(ConfigModel):
    """k: the screen's top cells (smallest p, then largest |value|) re-tested; n: fresh prompts (default:
    as many as the screen's); seed: the fresh prompts' seed (default: the screen's seed + 1,000,003)."""

    k: int = Field(default=10, ge=1, le=100_000, description="the screen's top cells re-tested (smallest p, then "
                   "largest |value|)")
    n: int | None = Field(default=None, ge=2, description="fresh prompts (default: as many as the screen's)")
    seed: int | None = Field(default=None, ge=0, description="seed of the fresh prompts (default: the screen's seed "
                             "+ 1,000,003)")


def fresh_data(data: Any, confirm: Confirm, name: str) -> dict[str, Any]:
    """The confirmation's data: the screen's task with another seed (and `confirm.n` prompts); refused,
    before anything runs, for data that cannot make fresh prompts."""
    if hasattr(data, "model_dump") and getattr(data, "task", None):  # a DataSpec (YAML, the CLI)
        data = {k: v for k, v in data.model_dump().items() if k in ("task", "n", "seed", "params") and v}
    made = getattr(data, "params", None)
    if not isinstance(data, dict) and isinstance(made, Mapping) and made.get("task"):  # a built-in task's Dataset
        made = {k: v for k, v in made.items() if isinstance(v, (str, int, float, bool, list))}
        own = {k: v for k, v in made.items() if k not in ("task", "n", "seed")}
        data = {k: made[k] for k in ("task", "n", "seed") if k in made} | ({"params": own} if own else {})
    if not isinstance(data, dict) or "task" not in data:
        raise ConfigError(f"{name}: confirm re-tests the top cells on fresh prompts of the same task, and this data "
                          f"({type(data).__name__}) cannot make fresh prompts", code="confirm_needs_task",
                          remedy="pass the data as a task ({task: ioi, n: 32}), or hold out prompts yourself and run "
                          "the top cells again on them")
    seed = confirm.seed if confirm.seed is not None else int(data.get("seed", 0) or 0) + SEED_STEP
    return {**data, "n": confirm.n or data.get("n", 16), "seed": seed}


def check_testable(stats: Any, name: str) -> None:
    """Refuse confirm where the tables carry no p (n_boot 0): the confirmation would test nothing."""
    if not getattr(stats, "n_boot", 0):
        raise ConfigError(f"{name}: confirm re-tests the top cells, and with stats.n_boot 0 no p-value is computed, "
                          "so nothing would be tested (nor ranked by p)", code="confirm_no_test",
                          remedy="set stats.n_boot (1000 for reported intervals), or leave confirm out")


GROWTH = 2  # the generator is asked for this many times more prompts when too few new ones came back
MAX_DRAWS = 16  # ... up to this many times n


def _key(example: Any) -> Any:
    p = example.prompt
    return p if isinstance(p, str) else tuple(p)


def fresh_prompts(spec: dict[str, Any], screen: Dataset | None, tokenizer: Any, name: str) -> tuple[Dataset, dict[str, Any]]:
    """The confirmation's prompts: n (spec["n"]) prompts of the task at the fresh seed, none of them one of the
    screen's and none twice. The generator is asked for n; when repeats or screen prompts leave fewer than n, for
    GROWTH times more (up to MAX_DRAWS x n), keeping the first new ones in the generator's order. Fewer than n: a warning (confirm_fresh_capped) and what there is; fewer than
    2: refused (confirm_no_fresh). Returns the dataset and a record for the manifest."""
    n = int(spec["n"])
    seen = {_key(e) for e in screen} if screen is not None else set()
    draw, best = n, None
    while True:
        made = load_data({**spec, "n": draw}, tokenizer=tokenizer)
        kept, keys = [], set()
        for e in made:
            k = _key(e)
            if k in seen or k in keys:
                continue
            keys.add(k)
            kept.append(e)
            if len(kept) == n:
                break
        if best is None or len(kept) > len(best[1]):
            best = (made, kept, draw)
        if len(kept) >= n or draw >= MAX_DRAWS * n:
            break
        draw *= GROWTH
    made, kept, _ = best
    record = {"asked": n, "prompts": len(kept), "drawn": draw, "screen_prompts": len(seen)}  # draw: the largest
    if len(kept) < 2:
        raise DataError(f"{name}: confirm needs fresh prompts of task {spec.get('task')!r} that the screen did not "
                        f"use, and the task made only {len(kept)} among up to {draw} drawn (the screen used {len(seen)})",
                        code="confirm_no_fresh", remedy="screen on fewer prompts so that some are left, or split "
                        "your own prompts and run the top cells on the held-out part")
    if len(kept) < n:
        warn(f"confirm asked for {n} fresh prompts, and task {spec.get('task')!r} makes only {len(kept)} that are not "
             f"among the screen's {len(seen)} prompts and not repeated (up to {draw} drawn): the confirmation runs on those "
             f"{len(kept)}", code="confirm_fresh_capped")
    if len(kept) == len(made):
        return made, record
    return Dataset(made.name, tuple(kept), made.description, made.params), record


def tested_stem(table: pd.DataFrame) -> str:
    """The column a table tests against 0: the one with `_p`, `_q` and an interval (value, mean, score)."""
    for c in table.columns:
        if c.endswith("_p") and f"{c[:-2]}_q" in table and f"{c[:-2]}_ci_low" in table:
            return c[:-2]
    raise ConfigError("this table tests nothing against 0, so there is nothing to confirm",
                      code="confirm_unsupported", remedy="leave confirm out")


def key_of(table: pd.DataFrame) -> list[str]:
    """The columns that name a row: its id column, after `kind` where the table has one (head scores: a head
    is a row once per kind)."""
    for k in KEYS:
        if k in table:
            return (["kind"] if "kind" in table else []) + [k]
    raise ConfigError("the table has no row names to match on fresh prompts", code="confirm_unsupported",
                      remedy="leave confirm out")


def top_rows(table: pd.DataFrame, k: int) -> pd.DataFrame:
    """The screen's top k rows: smallest p, then largest |value| (rows without a p last)."""
    stem = tested_stem(table)
    order = pd.DataFrame({"p": table[f"{stem}_p"].fillna(np.inf).to_numpy(float),
                          "v": -table[stem].abs().fillna(-np.inf).to_numpy(float)}).sort_values(["p", "v"], kind="stable")
    return table.iloc[order.index[:k]]


def confirmation_table(screen: pd.DataFrame, fresh: pd.DataFrame, k: int, fdr: float, n_screen: int,
                       n_fresh: int) -> pd.DataFrame:
    """Both stages of the top k cells, one row each: the screen's value, interval, p and q (over all m cells),
    and the fresh prompts' value, interval, p and q (Benjamini-Hochberg over the k), `confirmed` = q <= fdr."""
    stem, key = tested_stem(screen), key_of(screen)
    top = top_rows(screen, k)
    again = fresh.set_index(key).reindex(pd.MultiIndex.from_frame(top[key]) if len(key) > 1 else top[key[0]])
    out = pd.DataFrame({c: top[c].to_numpy() for c in key})
    for c in ("", "_ci_low", "_ci_high", "_p", "_p_bound", "_q"):
        if f"{stem}{c}" in top:
            out[f"screen_{stem}{c}"] = top[f"{stem}{c}"].to_numpy()
    out["screen_n_prompts"] = n_screen
    for c in ("", "_ci_low", "_ci_high", "_p", "_p_bound"):
        out[f"{stem}{c}"] = again[f"{stem}{c}"].to_numpy()
    out[f"{stem}_q"] = benjamini_hochberg(out[f"{stem}_p"].to_numpy(float))
    out["confirmed"] = np.where(np.isfinite(out[f"{stem}_q"]), out[f"{stem}_q"] <= fdr, False)
    out["n_prompts"] = n_fresh
    out["ci_level"] = fresh["ci_level"].iloc[0] if "ci_level" in fresh else np.nan
    return out


def confirmation_note(table: pd.DataFrame, fdr: float) -> str:
    """One line for the page: how many of the k cells the fresh prompts confirm (or that no test was made, where
    the fresh prompts gave no p)."""
    stem = next(c[len("screen_"):] for c in table.columns if c.startswith("screen_") and c.endswith("_p"))[:-2]
    k, shown = len(table), int(table["confirmed"].sum())
    if not np.isfinite(table[f"{stem}_p"].to_numpy(float)).any():
        return (f"confirmation on {int(table['n_prompts'].iloc[0])} fresh prompts of the screen's top {k} cells: no "
                f"test was made (no p-value on the fresh prompts), so none is confirmed or refuted; `{stem}` and its "
                "interval are the fresh prompts' (confirmation.csv)")
    return (f"confirmation on {int(table['n_prompts'].iloc[0])} fresh prompts of the screen's top {k} cells "
            f"(smallest p): {shown} of {k} confirmed at a {fdr:.0%} false discovery rate (Benjamini-Hochberg over the "
            f"{k}); `{stem}` and its interval, p and q are the fresh prompts', `screen_{stem}...` the screen's "
            "(confirmation.csv)")
