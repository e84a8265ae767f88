"""What a reader should take from a steering table, in a few sentences computed from its numbers (every
number a quoted cell, every qualifier a rule of docs/pages.md and results/claims.py).

The rules (docs/steering.md): an effect is shown when its interval excludes 0; the sentence names the
smallest |coefficient| where it does (`smallest_effective`), the effect and the side effects there with
their intervals, and says the direction beats its random baseline when `beats_random` holds at that
coefficient. Where no coefficient's effect excludes 0 it says so (`none_effective`) and quotes the largest.
"""

from __future__ import annotations

from typing import Any

from ..results.claims import Takeaway, TakeawayBuilder
from .summary import smallest_effective

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
        b.quote(first, "direction_norm", name=f"{result.extra.get('direction_where', first['site'])} (norm", after=")", fmt=".3g", interval=False, q=False)
    else:
        b.say("the site")
    b.say(f", mode {first['mode']}: ")
    row = smallest_effective(t)
    if row is None:
        _no_effect(b, t, metric)
        return b.build()
    c = float(row["coefficient"])
    random = t[(t["direction"] == "random") & (t["coefficient"] == c)].iloc[0]
    b.say("the ")
    word = b.qualify("smallest coefficient", "smallest_effective")
    b.say(f" whose effect on the {metric} has a ")
    b.constant(first["ci_level"], "ci_level", fmt=".0%")
    b.say(" interval excluding zero is c = ")
    b.quote(row, "coefficient", name=False, fmt="g", interval=False, q=False)
    b.say(": effect ")
    effect = b.quote(row, "effect", name=False, fmt="+.3g")
    b.refer(word, [effect])
    b.say(f" (unsteered {metric} ")
    b.quote(first, "metric_unsteered", name=False, fmt=".3g")
    b.say("; bootstrap over ")
    b.constant(first["n_prompts"], "n_prompts", unit="prompts")
    b.say("). A random direction of the same norm moves it ")
    b.quote(random, "effect", name=False, fmt="+.3g")
    b.say(" (direction minus random ")
    minus = b.quote(row, "minus_random", name=False, fmt="+.3g")
    beats = bool(row["beats_random"])
    b.say("): the direction ")
    b.qualify("beats" if beats else "does not beat", "beats_random" if beats else "not_beats_random", [effect, minus])
    b.say(" its random baseline there.")
    if "kl" in t:
        _side_effects(b, t, row, random)
    return b.build()


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
