"""What a reader should take from a steering table, in a few sentences computed from its numbers.

The rules (docs/steering.md): an effect is shown when its interval excludes 0; the sentence names the
smallest |coefficient| where it does, the effect and the side effects there with their intervals, and
says the direction beats its random baseline when `beats_random` holds at that coefficient.
"""

from __future__ import annotations

from typing import Any

from ..stats import value_with_ci
from .summary import smallest_effective


def steering_takeaway(result: Any) -> str:
    t = result.table
    if not len(t):
        return ""
    first = t.iloc[0]
    level = int(round(100 * float(first["ci_level"])))
    metric, n = str(first["metric"]), int(first["n_prompts"])
    what = result.extra.get("direction_text", "the direction")
    row = smallest_effective(t)
    base = f"unsteered {metric} {value_with_ci(first, 'metric_unsteered', '.3g')}"
    if row is None:
        best = t[t["direction"] == "direction"]
        biggest = best.iloc[int(best["effect"].abs().to_numpy().argmax())]
        return (f"Steering with {what}: no coefficient moves the {metric} by an amount whose {level}% interval "
                f"excludes 0 (largest: c = {biggest['coefficient']:g}, effect "
                f"{value_with_ci(biggest, 'effect', '+.3g')}; "
                f"{base}; {n} prompts).")
    c = float(row["coefficient"])
    random = t[(t["direction"] == "random") & (t["coefficient"] == c)].iloc[0]
    text = (f"Steering with {what}: the smallest coefficient whose effect on the {metric} has a {level}% interval "
            f"excluding 0 is c = {c:g}: effect {value_with_ci(row, 'effect', '+.3g')} ({base}; bootstrap over "
            f"{n} prompts). A random direction of the same norm moves it {value_with_ci(random, 'effect', '+.3g')} "
            f"(direction minus random {value_with_ci(row, 'minus_random', '+.3g')}): the direction "
            f"{'beats' if bool(row['beats_random']) else 'does not beat'} its random baseline there.")
    if "kl" in t:
        text += (f" Side effects on {int(row['n_held_out'])} held-out prompts at c = {c:g}: "
                 f"KL(steered || unsteered) {value_with_ci(row, 'kl', '.3g')} nats per position (random: "
                 f"{value_with_ci(random, 'kl', '.3g')}), loss change {value_with_ci(row, 'loss_change', '+.3g')} nats")
        tasks = [col[: -len("_change")] for col in t.columns if col.endswith("_change") and col != "loss_change"
                 and not col.startswith("loss")]
        if tasks:
            text += "; task scores " + ", ".join(f"{k} {value_with_ci(row, k + '_change', '+.3g')}" for k in tasks)
        text += "."
    return text
