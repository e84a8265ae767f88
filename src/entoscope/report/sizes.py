"""How big the report's runs are on a model: each section's sizes, chosen from what a forward costs.

A model's cost is its forward's multiply-adds per token (Kaplan et al. 2020 count 2N FLOPs, N the weights
a token passes through): per block 4 d_model^2 (attention's q, k, v, o) and 2 d_model d_mlp (3 for a gated
MLP), then d_model d_vocab (the unembedding). The demo model costs 0.8 M; SmolLM2-135M 147 M, Gemma 3
270M 259 M. A model up to SMALL_MACS runs each section with its `small` sizes (the demo's, what the pages'
tests read); a larger one with its `large` sizes, fewer prompts and cheaper settings chosen so that the
report on SmolLM2 fits its targets on a 2-core CPU (benchmarks/bench_report_real.py: `--quick` in 3
minutes, the full report in 10). Every size a section uses is written on its page and in the report's
`manifest.json` (`sizes`), with the model's cost.

The lens section fits a Jacobian lens (lens/jacobian_fit.py: d_model vector-Jacobian products through
every token of every text) on a budget of JACOBIAN_BUDGET multiply-adds, counted as tokens x d_model x the
blocks' multiply-adds per token: the texts are cut to what the budget buys (at most the small sizes), and
where that leaves fewer than JACOBIAN_MIN_POSITIONS fitted positions a text the section fits no
Jacobian lens and says so on its page. The probes of a large model are fitted at a few layers spread evenly
from the first to the last (their fits, not the model's forwards, are most of the probing section's time).

**Screens.** A section whose table tests every cell against 0 (head scores, DLA, patching, circuits: the
operation's `tests_cells`) is sized by its plan's screen (stats/signflip.py `screen_limits`): the number of
prompts (a setting named `n` or `*_n`) is the table's, raised where needed to the fewest at which a cell can
be a discovery on its own with room to spare: the smallest q of a cell alone (the sign-flip test's
smallest p on those prompts times the cells tested) at most fdr / SCREEN_HEADROOM, so a cell with up to
about two prompts of the other sign (the smallest ones) still passes Benjamini-Hochberg. The cells are the
plan's, on this model: a model with more layers or heads gets more prompts. The prompts a screen adds are
bought within SCREEN_BUDGET multiply-adds a section (the plan's prompt forwards and backwards, a backward
counted as two forwards, times the prompts' tokens, times `forward_macs`); where the budget cannot buy
them the section keeps what it can afford and its entry in `screens` says so in words (the report's page
prints it beside the section). The plan is read without running the model (`Operation.prepare_for`), once
per model, section and `--quick`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from ..models.adapter import adapt

SMALL_MACS = 10e6  # per token: up to this a model is "small" (the demo: 0.8 M)

IOI_ROLES = ("IO", "S1", "S1+1", "S2", "S2+1", "END")  # the patching section's exact residual-stream map
IOI_TOKENS = ("IO", "S1", "S2", "END")  # ... on a large model: the names and the last token
ALL_COEFFICIENTS = (-1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5)  # the steering section's, x the residual's mean norm
# section -> setting -> (small quick, small full, large quick, large full)
# (a setting named n or *_n is a number of prompts: raised where the section's screen needs more, see above)
SIZES: dict[str, dict[str, tuple[Any, Any, Any, Any]]] = {
    "head_scores": {"n": (8, 32, 8, 32)},
    "dla": {"n": (8, 32, 8, 32)},
    "features": {"n": (24, 96, 24, 96)},
    "lens": {"n": (8, 32, 8, 32), "jacobian_texts": (2, 16, 2, 2), "jacobian_max_length": (48, 128, 48, 128)},
    "circuits": {"n": (16, 48, 16, 24), "method": ("eap_ig", "eap_ig", "eap", "eap_ig"), "steps": (5, 5, 1, 3),
                 "faithfulness": ("mib", "mib", "coarse", "coarse"), "routes_n": (8, 16, 8, 16),
                 "budget": (0.2, 0.2, 0.05, 0.05), "search_steps": (6, 6, 4, 6)},
    "patching": {"n": (8, 32, 16, 32), "method": ("exact", "exact", "attribution", "attribution"),
                 "max_layers": (None, None, 6, 12), "positions": (IOI_ROLES, IOI_ROLES, IOI_TOKENS, IOI_TOKENS),
                 "recheck": (0, 0, 5, 5)},
    "probing": {"greater_than_n": (96, 320, 64, 192), "ioi_n": (160, 512, 64, 192),
                "max_layers": (None, None, 8, 12)},
    "steering": {"n": (32, 128, 16, 32), "direction_n": (64, 256, 32, 64), "side_effects_n": (16, 64, 6, 16),
                 "coefficients": (ALL_COEFFICIENTS, ALL_COEFFICIENTS, (-0.1, -0.03, 0.03, 0.1),
                                  (-0.3, -0.1, -0.03, 0.03, 0.1, 0.3)),
                 "continuation_prompts": (3, 3, 1, 3)},
}
COARSE_FRACTIONS = (0.01, 0.05, 0.2, 1.0)  # the faithfulness curve of a large model: 4 of MIB's 10 fractions
JACOBIAN_BUDGET = {True: 1.5e12, False: 4e12}  # multiply-adds, by quick
JACOBIAN_SKIP_FIRST = 4
JACOBIAN_MIN_POSITIONS = 12
SCREEN_HEADROOM = 4  # a screen's smallest q of a cell alone at most fdr / 4 (module docstring)
SCREEN_BUDGET = {True: 1.5e12, False: 4e12}  # multiply-adds the prompts a section's screens add may cost, by quick
SCREEN_MAX_PROMPTS = 512  # the most prompts a screen is raised to


def forward_macs(model: Any) -> float:
    """Multiply-adds of one token's forward (module docstring)."""
    s = adapt(model).structure
    return float(s.n_layers * block_macs(s) + s.d_model * s.d_vocab)


def block_macs(s: Any) -> float:
    return 4 * s.d_model ** 2 + (3 if s.gated_mlp else 2) * s.d_model * s.d_mlp


def tier(model: Any) -> str:
    return "small" if forward_macs(model) <= SMALL_MACS else "large"


def sizes(model: Any, section: str, quick: bool) -> dict[str, Any]:
    """The settings `section` runs with on `model`: SIZES' column for the model's tier and quick, with the
    prompts its screens need (`screens`)."""
    col = (0 if quick else 1) + (0 if tier(model) == "small" else 2)
    out = {k: v[col] for k, v in SIZES.get(section, {}).items()}
    if _FITTING.get():  # the section's runs are being read for their screens: each n says which setting it is
        out = {k: Prompts(v, k) if is_prompts(k, v) else v for k, v in out.items()}
    else:
        out.update(_fitted(model, section, quick)["n"])
    if section == "lens":
        out.update(jacobian_sizes(model, quick, out["jacobian_texts"], out["jacobian_max_length"]))
    if "max_layers" in out:
        out["layers"] = spread_layers(adapt(model).structure.n_layers, out.pop("max_layers"))
    if section == "circuits" and "routes_n" in out and not _FITTING.get():
        # the routes' head scores are the head-scores section's prompts (same task, seed and period) over 2 of
        # its 3 kinds: that section's prompts let their screen see too
        out["routes_n"] = max(out["routes_n"], sizes(model, "head_scores", quick)["n"])
    return out


def screens(model: Any, section: str, quick: bool) -> list[dict[str, Any]]:
    """What each screen of `section` can show at the report's sizes: one record a run that tests its cells
    (setting, cells, prompts, the smallest p and q of a cell alone, the p a discovery needs), and, where the
    budget could not buy the prompts the screen needs, `limited` in words."""
    return _fitted(model, section, quick)["screens"]


class Prompts(int):
    """A number of prompts from SIZES that remembers its setting while the screens are fitted (how a run's
    data is traced back to the setting it came from)."""

    key: str

    def __new__(cls, value: int, key: str) -> Prompts:
        obj = super().__new__(cls, value)
        obj.key = key
        return obj


def is_prompts(key: str, value: Any) -> bool:
    return (key == "n" or key.endswith("_n")) and isinstance(value, int) and not isinstance(value, bool)


_FITTING: contextvars.ContextVar[bool] = contextvars.ContextVar("report_sizes_fitting", default=False)
_FITTED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], dict[str, Any]]] = weakref.WeakKeyDictionary()


def _fitted(model: Any, section: str, quick: bool) -> dict[str, Any]:
    """{"n": setting -> prompts, "screens": [...]}, once per model, section and quick (and sizing rules)."""
    a = adapt(model)
    memo = _FITTED.setdefault(a.module, {})
    key = (section, quick, tier(model), repr(SIZES.get(section)), SCREEN_HEADROOM, SCREEN_BUDGET[quick],
           SCREEN_MAX_PROMPTS)
    if key not in memo:
        memo[key] = _fit(model, section, quick)
    return memo[key]


def _fit(model: Any, section: str, quick: bool) -> dict[str, Any]:
    from ..registry import lookup

    try:
        runs = getattr(lookup("report_section", section), "runs", None)
    except Exception:  # noqa: BLE001 - not a report section: nothing to fit
        runs = None
    if runs is None:
        return {"n": {}, "screens": []}
    token = _FITTING.set(True)
    found: list[dict[str, Any]] = []
    try:
        with warnings.catch_warnings():  # the screens at the table's sizes: what they warn is what is fixed here
            warnings.simplefilter("ignore")
            for op, data in runs(model, quick):
                n = data.get("n") if isinstance(data, dict) else None
                if not getattr(op, "tests_cells", False) or getattr(n, "key", None) is None:
                    continue
                prepared = op.prepare_for(model, data)
                shared = _SHARED.get()
                if shared is not None:
                    shared[run_key(op, data)] = prepared
                if prepared.plan.screen is not None:
                    found.append(_screen_of(op, prepared, int(n), n.key))
    except Exception:  # noqa: BLE001 - a run the model cannot make: the preflight refuses it and says why
        found = []
    finally:
        _FITTING.reset(token)
    chosen: dict[str, int] = {}
    for key in dict.fromkeys(f["key"] for f in found):
        mine = [f for f in found if f["key"] == key]
        base = mine[0]["base"]
        need = max(f["need"] for f in mine)
        per_prompt = sum(f["macs_per_prompt"] for f in mine)
        afford = base + int(SCREEN_BUDGET[quick] // max(per_prompt, 1.0))
        chosen[key] = max(base, min(need, afford))
        for f in mine:
            f["prompts"] = chosen[key]
            if need > afford:
                f["limited"] = (f"{f['cells']:,} cells need {need} prompts for a cell to be a discovery on its own "
                                f"with room to spare; the report's time budget for this section buys {chosen[key]}")
            elif f["need_words"]:
                f["limited"] = f["need_words"]
    screens_out = []
    for f in found:
        limits = _limits(f["stats"], f["cells"], math.ceil(f["prompts"] * f["ratio"]))
        screens_out.append({"setting": f["key"], "operation": f["operation"], "cells": f["cells"],
                            "prompts": f["prompts"], "table_prompts": f["base"], "min_p": limits["min_p"],
                            "min_q_alone": limits["min_q_alone"], "needed_p": limits["needed_p"],
                            "blind": limits["blind"], **({"limited": f["limited"]} if "limited" in f else {})})
    return {"n": chosen, "screens": screens_out}


_SHARED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("report_sizes_shared", default=None)


@contextlib.contextmanager
def sharing_plans() -> Iterator[dict[str, Any]]:
    """While open, the runs the screens' fit prepares are kept here by `run_key`: the preflight takes those
    whose sizes the fit left as they were instead of preparing them again (then they are dropped)."""
    shared: dict[str, Any] = {}
    token = _SHARED.set(shared)
    try:
        yield shared
    finally:
        _SHARED.reset(token)
        shared.clear()


def run_key(op: Any, data: Any) -> str:
    return json.dumps([op.config(), data], sort_keys=True, default=str)


def _screen_of(op: Any, prepared: Any, base: int, key: str) -> dict[str, Any]:
    """One run's screen: its cells, the prompts it needs (from `base` up) and what a prompt costs."""
    plan, stats = prepared.plan, op.stats
    cells = int(plan.screen["m"])
    ratio = plan.examples / max(base, 1)  # examples the run counts a prompt of the setting
    need, words = base, ""
    for k in range(base, SCREEN_MAX_PROMPTS + 1):
        if _limits(stats, cells, math.ceil(k * ratio))["min_q_alone"] <= stats.fdr / SCREEN_HEADROOM:
            need = k
            break
    else:
        words = (f"no number of prompts from {base} to {SCREEN_MAX_PROMPTS} lets one of its {cells:,} cells be a "
                 "discovery on its own with room to spare (the sign-flip test's resolution)")
    a = prepared.model
    examples = list(prepared.data) if prepared.data is not None else []
    tokens = sum(len(a.tokenize(e.prompt)) for e in examples) / max(len(examples), 1)
    passes = (plan.forward_passes + 2 * plan.backward_passes) / max(base, 1)
    return {"key": key, "operation": op.name, "base": base, "cells": cells, "ratio": ratio, "need": need,
            "need_words": words, "stats": stats, "macs_per_prompt": passes * tokens * forward_macs(a)}


def _limits(stats: Any, cells: int, examples: int) -> dict[str, Any]:
    from ..stats.signflip import screen_limits

    return screen_limits(examples, cells, stats.fdr, n_boot=stats.n_boot, method=stats.ci_method,
                         refine_p=stats.refine_p, effects=())


def spread_layers(n_layers: int, k: int | None) -> str | list[int]:
    """At most k layers spread evenly from the first to the last ("all" where k is None or k >= n_layers)."""
    if k is None or k >= n_layers:
        return "all"
    return sorted({round(i * (n_layers - 1) / (k - 1)) for i in range(k)})


def jacobian_sizes(model: Any, quick: bool, texts: int, max_length: int) -> dict[str, Any]:
    """The Jacobian lens fit's texts and their length within the budget; `jacobian_fit` False where the budget
    leaves fewer than JACOBIAN_MIN_POSITIONS positions a text."""
    s = adapt(model).structure
    per_token = s.d_model * s.n_layers * block_macs(s)
    length = int(min(max_length, JACOBIAN_BUDGET[quick] // (per_token * texts)))
    fits = length - JACOBIAN_SKIP_FIRST >= JACOBIAN_MIN_POSITIONS
    return {"jacobian_fit": fits, "jacobian_texts": texts, "jacobian_max_length": length,
            "jacobian_skip_first": JACOBIAN_SKIP_FIRST, "jacobian_budget_macs": JACOBIAN_BUDGET[quick],
            "jacobian_macs": float(per_token * texts * length)}
