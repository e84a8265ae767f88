"""Built-in tasks: seeded generators of `Dataset`s (prompts, counterfactuals, answers, labels).

    from entoscope.data import tasks
    data = tasks.ioi(n=64, seed=0)            # or tasks.get("ioi", n=64), as YAML's {task: ioi, n: 64}

With `tokenizer` given, a generator keeps only the words that are one token (after a space) under it
and raises TaskVocabularyError (a ValueError) when too few remain; without one, the bundled demo
tokenizer's vocabulary is assumed (every word of `vocab` is one token there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from entoscope.data.examples import Dataset
from entoscope.data.tasks._common import TaskVocabularyError
from entoscope.data.tasks.facts import facts
from entoscope.data.tasks.greater_than import greater_than
from entoscope.data.tasks.induction import induction, repeated_tokens
from entoscope.data.tasks.ioi import ioi

TASKS: dict[str, Callable[..., Dataset]] = {
    "ioi": ioi,
    "induction": induction,
    "facts": facts,
    "greater_than": greater_than,
    "repeated_tokens": repeated_tokens,
}


def get(name: str, **kwargs: Any) -> Dataset:
    """The dataset of the task called `name` ("greater-than" and "Greater_Than" work too)."""
    key = name.strip().lower().replace("-", "_")
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; the built-in tasks are {sorted(TASKS)}")
    return TASKS[key](**kwargs)


__all__ = [
    "TASKS", "TaskVocabularyError", "facts", "get", "greater_than", "induction", "ioi", "repeated_tokens",
]
