"""The prompts of one steering run, as one dataset of tagged sets (so that one shard plan covers them all).

A run steers the task's prompts, and also held-out text, each built-in task's prompts, and (a direction
made by the run) reads the direction's own prompts. They are one Dataset, in this order, each example's
`meta["steering_set"]` naming its set:

    task                 the data given to the run (the effect is measured here)
    text                 side_effects.text: held-out text (KL and loss change)
    score:<task>         side_effects.tasks: a built-in task's prompts (its score's change; KL and loss too)
    direction+ / -       mean_difference with a negative set: the positive / negative prompts
    direction=           mean_difference of pairs: each prompt with its counterfactual

The run's manifest records this dataset, so `entoscope run manifest.json` (and a Ray worker) gets the
same rows back: a dataset whose examples are tagged is used as it is, never extended again. Held-out
prompts that are also prompts the direction was made from are left out (the plan says how many).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..data.examples import Dataset, Example

SET_KEY = "steering_set"
TASK, TEXT = "task", "text"
SCORE = "score:"
DIRECTION_SETS = ("direction+", "direction-", "direction=")


@dataclass(frozen=True)
class RowSet:
    name: str
    lo: int
    hi: int

    @property
    def n(self) -> int:
        return self.hi - self.lo

    @property
    def held_out(self) -> bool:
        """Side-effect rows: held-out text and the built-in tasks' prompts."""
        return self.name == TEXT or self.name.startswith(SCORE)

    @property
    def steered(self) -> bool:
        return self.name not in DIRECTION_SETS


def tagged(data: Dataset) -> bool:
    return bool(len(data)) and all(SET_KEY in e.meta for e in data)


def combine(task: Dataset, others: list[tuple[str, Dataset]]) -> Dataset:
    """One dataset of the task's examples followed by the others', each tagged with its set."""
    examples = [_tag(e, TASK) for e in task]
    for name, data in others:
        examples += [_tag(e, name) for e in data]
    params = {**dict(task.params), "steering_sets": {TASK: len(task), **{n: len(d) for n, d in others}}}
    return Dataset(task.name, tuple(examples), task.description, params)


def _tag(example: Example, name: str) -> Example:
    return dataclasses.replace(example, meta={**dict(example.meta), SET_KEY: name})


def split(data: Dataset) -> tuple[list[RowSet], dict[str, Dataset]]:
    """The sets of a tagged dataset (contiguous, in order) and each set as its own Dataset (tags removed)."""
    sets: list[RowSet] = []
    parts: dict[str, list[Example]] = {}
    for i, e in enumerate(data):
        name = str(e.meta[SET_KEY])
        if sets and sets[-1].name == name:
            sets[-1] = RowSet(name, sets[-1].lo, i + 1)
        else:
            if name in parts:
                raise ValueError(f"set {name!r} is not contiguous in the steering dataset")
            sets.append(RowSet(name, i, i + 1))
            parts[name] = []
        meta = {k: v for k, v in e.meta.items() if k != SET_KEY}
        parts[name].append(dataclasses.replace(e, meta=meta))
    datasets = {name: Dataset(data.name if name == TASK else name, tuple(ex), "", {}) for name, ex in parts.items()}
    return sets, datasets


def without(data: Dataset, digests: set[str], digest: Any) -> tuple[Dataset, int]:
    """`data` without the examples whose prompt's digest is in `digests`, and how many were dropped."""
    kept = tuple(e for e in data if digest(e.prompt) not in digests)
    return Dataset(data.name, kept, data.description, data.params), len(data) - len(kept)
