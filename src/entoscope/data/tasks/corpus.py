"""A small built-in text corpus for fitting lenses: paragraphs made of the other tasks' sentences.

Each text joins `sentences` completed prompts of the built-in tasks (IOI, facts, greater-than, induction),
each prompt followed by its answer and a full stop, in a seeded random order. The texts are long enough
(about 60 demo-tokenizer tokens for 4 sentences) for estimators that skip a text's first positions, such
as the Jacobian lens (docs/lens.md). No answers or counterfactuals: a corpus is only text.
"""

from __future__ import annotations

import random
from typing import Any

from entoscope.data.examples import Dataset, Example
from entoscope.data.roles import strip_markers
from entoscope.data.tasks._common import TaskParamError


def corpus(n: int = 64, seed: int = 0, sentences: int = 4, tokenizer: Any = None) -> Dataset:
    """`n` texts of `sentences` completed task prompts each (seeded)."""
    from entoscope.data.tasks.facts import facts
    from entoscope.data.tasks.greater_than import greater_than
    from entoscope.data.tasks.induction import induction
    from entoscope.data.tasks.ioi import ioi

    if n < 0:
        raise TaskParamError(f"corpus: n must be >= 0, got {n}")
    if sentences < 1:
        raise TaskParamError(f"corpus: sentences must be >= 1, got {sentences}")
    need = n * sentences
    pool: list[str] = []
    for i, make in enumerate((ioi, facts, greater_than, induction)):
        for ex in make(n=need // 4 + 1, seed=seed * 7 + i, tokenizer=tokenizer):
            text, _ = strip_markers(ex.prompt)
            pool.append(text + (ex.answers[0] if ex.answers else "") + ".")
    rng = random.Random(seed)
    rng.shuffle(pool)
    texts = [" ".join(pool[j * sentences:(j + 1) * sentences]) for j in range(n)]
    return Dataset("corpus", tuple(Example(prompt=t) for t in texts),
                   description=f"{n} texts of {sentences} completed task sentences",
                   params={"n": n, "seed": seed, "sentences": sentences})
