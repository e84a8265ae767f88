"""What a reader should take from a steering table, in a few sentences computed from its numbers (every
number a quoted cell, every qualifier a rule of docs/pages.md and results/claims.py).

The rules (docs/steering.md), material before negligible:
- an effect is **material** at a coefficient when its interval lies wholly beyond 5% of the unsteered
  metric's size (`material`); the takeaway then names the smallest |coefficient| where it is
  (`smallest_material`), the effect, and in the same lead the random baseline's and (direction - random): the
  direction beats its random baseline when `beats_random` holds at that coefficient, and the lead says which
  (an effect a random vector of the same norm matches is not the direction's); the side effects follow;
- with no material effect, and every direction row's interval inside that band, the effect is
  **negligible** (`negligible`): said first, with the largest |effect|;
- otherwise (some interval reaches past the band but none lies beyond it) the old rule: the smallest
  |coefficient| whose effect's interval excludes 0 (`smallest_effective`), and that no coefficient's effect is
  material (`none_material`); or, where none excludes 0, says so (`none_effective`) and quotes the largest.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..results.claims import Takeaway, TakeawayBuilder
from .summary import NEGLIGIBLE, smallest_effective

KEY = "condition"


def steering_takeaway(result: Any) -> Takeaway | str:
    t = result.table
    if not len(t):
        return ""
    first = t.iloc[0]
    metric = str(first["metric"])
    source = str(result.extra.get("direction_source", "given")).replace("_", "-")
    b = TakeawayBuilder(key=KEY)
    b.say(f"Steering with the {source} direction at ")
    if "direction_norm" in t:
        b.quote(first, "direction_norm", name=f"{result.extra.get('direction_where', first['site'])} (norm", after=")",
                fmt=".3g", interval=False, q=False)
    else:
        b.say("the site")
    b.say(": ")
    has_bands = "material" in t and "negligible" in t
    row = smallest_effective(t, "material") if has_bands else None
    steered = t[t["direction"] == "direction"]
    if row is not None:
        _effect(b, t, row, metric, material=True)
    elif has_bands and steered["negligible"].astype(bool).all():
        _negligible(b, t, metric)
    elif (row := smallest_effective(t)) is None:
        _no_effect(b, t, metric)
    else:
        _effect(b, t, row, metric, material=False)
    if not b.lead_ended:
        b.end_lead()
    _units(b, t)
    return b.build()


def _units(b: TakeawayBuilder, t: Any) -> None:
    """Below the lead: the mode and the coefficients' unit."""
    first = t.iloc[0]
    b.say(f" Mode {first['mode']}")
    if "residual_norm" in t and pd.notna(first.get("residual_norm")):
        b.say("; coefficients in units of the site's mean activation norm R = ")
        b.quote(first, "residual_norm", name=False, fmt=".3g", interval=False, q=False)
    b.say(".")


def _band(b: TakeawayBuilder, t: Any, metric: str) -> None:
    """' 5% of the unsteered <metric>': the band (the table's `negligible_share`, the same on every row)."""
    b.say(" ")
    b.constant(t["negligible_share"].iloc[0] if "negligible_share" in t else NEGLIGIBLE, "negligible_share",
               fmt=".0%")
    b.say(f" of the unsteered {metric}")


def _effect(b: TakeawayBuilder, t: Any, row: Any, metric: str, *, material: bool) -> None:
    first = t.iloc[0]
    c = float(row["coefficient"])
    random = t[(t["direction"] == "random") & (t["coefficient"] == c)].iloc[0]
    b.say("the ")
    if material:
        word = b.qualify("smallest coefficient with a material effect", "smallest_material")
        b.say(f" on the {metric} is c = ")
    else:
        word = b.qualify("smallest coefficient", "smallest_effective")
        b.say(f" whose effect on the {metric} excludes zero is c = ")
    b.quote(row, "coefficient", name=False, fmt="g", interval=False, q=False)
    b.say(": effect ")
    effect = b.quote(row, "effect", name=False, fmt="+.3g")
    b.refer(word, [effect])
    b.say(f" (unsteered {metric} ")
    b.quote(first, "metric_unsteered", name=False, fmt=".3g")
    b.say("). A random direction of the same norm moves it ")  # in the lead: an effect a random vector matches
    b.quote(random, "effect", name=False, fmt="+.3g")           # is not the direction's
    b.against_baseline(row, effect, minus="minus_random", beats="beats_random", what="direction",
                       other="random", baseline="baseline")
    b.end_lead()
    b.say(" That is, its ")
    b.constant(first["ci_level"], "ci_level", fmt=".0%")
    if material:
        b.say(" interval lies beyond")
        _band(b, t, metric)
    else:
        b.say(" interval excludes zero")
    b.say("; bootstrap over ")
    b.constant(first["n_prompts"], "n_prompts", unit="prompts")
    b.say(".")
    if not material and "material" in t:
        b.say(" Yet ")
        none = b.qualify("no coefficient's effect is material", "none_material")
        b.say(" (none lies wholly beyond")
        _band(b, t, metric)
        b.say("; the ")
        _largest_effect(b, t, none, ", at c = ")
        b.say("): a larger dose, or another direction, is needed to move it visibly.")
    if "kl" in t:
        _side_effects(b, t, row, random)


def _largest_effect(b: TakeawayBuilder, t: Any, claim: Any, between: str) -> None:
    """"largest{between}<c>: <effect>" for the steered row of largest |effect|, which backs `claim` too."""
    steered = t[t["direction"] == "direction"]
    biggest = steered.iloc[int(steered["effect"].abs().to_numpy().argmax())]
    largest = b.qualify("largest", "top_by_abs", condition="direction=direction")
    b.say(between)
    b.quote(biggest, "coefficient", name=False, fmt="g", interval=False, q=False)
    b.say(": ")
    ref = b.quote(biggest, "effect", name=False, fmt="+.3g")
    b.refer(claim, [ref])
    b.refer(largest, [ref])


def _negligible(b: TakeawayBuilder, t: Any, metric: str) -> None:
    b.say("its effect on the ")
    b.say(f"{metric} is ")
    word = b.qualify("negligible at every coefficient", "negligible")
    b.say(": each ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" interval lies within")
    _band(b, t, metric)
    b.say(" (unsteered ")
    b.quote(t.iloc[0], "metric_unsteered", name=False, fmt=".3g")
    b.say("; the ")
    _largest_effect(b, t, word, " |effect|, at c = ")
    b.say("; ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say("). Steering along it at these doses does not change what the model does on this task.")


def _no_effect(b: TakeawayBuilder, t: Any, metric: str) -> None:
    steered = t[t["direction"] == "direction"]
    biggest = steered.iloc[int(steered["effect"].abs().to_numpy().argmax())]
    none = b.qualify("no coefficient", "none_effective")
    b.say(f" moves the {metric} by an amount whose ")
    b.constant(t["ci_level"].iloc[0], "ci_level", fmt=".0%")
    b.say(" interval excludes zero (")
    largest = b.qualify("largest", "top_by_abs", condition="direction=direction")
    b.say(": c = ")
    b.quote(biggest, "coefficient", name=False, fmt="g", interval=False, q=False)
    b.say(", effect ")
    ref = b.quote(biggest, "effect", name=False, fmt="+.3g")
    b.refer(none, [ref])
    b.refer(largest, [ref])
    b.say(f"; unsteered {metric} ")
    b.quote(t.iloc[0], "metric_unsteered", name=False, fmt=".3g")
    b.say("; ")
    b.constant(t["n_prompts"].iloc[0], "n_prompts", unit="prompts")
    b.say(").")


def _side_effects(b: TakeawayBuilder, t: Any, row: Any, random: Any) -> None:
    b.say(" Side effects on ")
    b.constant(row["n_held_out"], "n_held_out", unit="held-out prompts")
    b.say(" at c = ")
    b.quote(row, "coefficient", name=False, fmt="g", interval=False, q=False)
    b.say(": KL(steered || unsteered) ")
    b.quote(row, "kl", name=False, fmt=".3g")
    b.say(" nats per position (random: ")
    b.quote(random, "kl", name=False, fmt=".3g")
    b.say("), loss change ")
    b.quote(row, "loss_change", name=False, fmt="+.3g")
    b.say(" nats")
    tasks = [col[: -len("_change")] for col in t.columns if col.endswith("_change") and col != "loss_change"]
    for i, task in enumerate(tasks):
        b.say("; task scores " if i == 0 else ", ")
        b.quote(row, f"{task}_change", name=task, fmt="+.3g")
    b.say(".")
