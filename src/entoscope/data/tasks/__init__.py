"""Built-in tasks: seeded generators of `Dataset`s (prompts, counterfactuals, answers, labels).

    from entoscope.data import tasks
    data = tasks.ioi(n=64, seed=0)            # or tasks.get("ioi", n=64), as YAML's {task: ioi, n: 64}

With `tokenizer` given, a generator keeps only the words that are one token (after a space) under it
and raises TaskVocabularyError (a ValueError) when too few remain; without one, the bundled demo
tokenizer's vocabulary is assumed (every word of `vocab` is one token there).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from entoscope.data.examples import Dataset
from entoscope.data.tasks._common import TaskParamError, TaskVocabularyError
from entoscope.errors import ConfigError, DataError
from entoscope.data.tasks.corpus import corpus
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
    "corpus": corpus,
}


def check(name: Any, params: dict[str, Any]) -> Callable[..., Dataset]:
    """The generator of task `name`, after checking that it takes `params` with values of the right type."""
    key = str(name).strip().lower().replace("-", "_") if isinstance(name, str) else None
    if key not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise DataError(f"unknown task {name!r} (the built-in tasks are {', '.join(sorted(TASKS))})",
                               code="unknown_task", remedy=f"{hint}use a built-in task, or for your own prompts "
                               "{path: file.jsonl} or {prompts: [...]}")
    fn = TASKS[key]
    sig = inspect.signature(fn)
    for param, value in params.items():
        if param not in sig.parameters:
            takes = [p for p in sig.parameters if p != "tokenizer"]
            raise ConfigError(f"task {key!r} has no parameter {param!r}", code="task_param_unknown",
                              remedy=f"{key} takes {', '.join(takes)}")
        expected = sig.parameters[param].default
        if isinstance(expected, (int, float, str)) and not isinstance(expected, bool) and value is not None:
            ok = isinstance(value, type(expected)) and not isinstance(value, bool) or \
                isinstance(expected, float) and isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                raise TaskParamError(f"task {key!r}: {param} must be a {type(expected).__name__}, got {value!r}")
    return fn


def get(name: str, **kwargs: Any) -> Dataset:
    """The dataset of the task called `name` ("greater-than" and "Greater_Than" work too)."""
    return check(name, {k: v for k, v in kwargs.items() if k != "tokenizer"})(**kwargs)


__all__ = [
    "TASKS", "TaskParamError", "corpus", "TaskVocabularyError", "check", "facts", "get", "greater_than", "induction", "ioi", "repeated_tokens",
]
