"""Steering: make a direction, add it (or clamp it, or project it out) at a site, and measure what it does.

    d = es.Direction.mean_difference(model, "resid_pre.2", {"task": "greater_than", "n": 128, "seed": 100})
    result = es.Steering(direction=d, coefficients=[-1, -0.5, 0.5, 1], metric="prob_diff").run(model, data)

docs/steering.md has the conventions (with the papers), the rule for "beats its random baseline", and
what each column means.
"""

from .direction import Direction
from .operation import Continuations, SideEffects, Steering
from .spec import DirectionSpec

__all__ = ["Continuations", "Direction", "DirectionSpec", "SideEffects", "Steering"]
