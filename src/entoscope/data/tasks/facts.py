"""Factual recall: country -> capital ("The capital of France is" -> " Paris")."""

from __future__ import annotations

import random
from typing import Any

from entoscope.data.examples import Dataset, Example
from entoscope.data.tasks import vocab
from entoscope.data.tasks._common import TaskParamError, TaskVocabularyError, encode, tokenizer_name

TEMPLATES: tuple[str, ...] = (
    "The capital of {country} is",
    "The capital city of {country} is",
    "In {country}, the capital city is",
    "The government of {country} is based in",
)


def facts(n: int = 64, seed: int = 0, tokenizer: Any = None) -> Dataset:
    """Country -> capital prompts over several templates; countries come in a seeded shuffled cycle.

    counterfactual: the same template with another country; wrong_answers: that country's capital.
    label: the country's index in `vocab.COUNTRIES`. meta: country, capital, template,
    counterfactual_country.
    """
    if n < 0:
        raise TaskParamError(f"facts: n must be >= 0, got {n}")
    pairs = [
        (i, country, capital)
        for i, (country, capital) in enumerate(vocab.COUNTRIES)
        if tokenizer is None
        or (len(encode(tokenizer, " " + country)) == 1 and len(encode(tokenizer, " " + capital)) == 1)
    ]
    if len(pairs) < 2:
        raise TaskVocabularyError(
            f"task 'facts': only {len(pairs)} of {len(vocab.COUNTRIES)} (country, capital) pairs are both "
            f"a single token (after a space) under tokenizer {tokenizer_name(tokenizer)!r}; "
            "the task needs at least 2"
        )
    rng = random.Random(seed)
    order: list[int] = []
    examples = []
    for _ in range(n):
        if not order:
            order = list(range(len(pairs)))
            rng.shuffle(order)
        j = order.pop()
        i, country, capital = pairs[j]
        _, other, other_capital = pairs[rng.choice([m for m in range(len(pairs)) if m != j])]
        t = rng.randrange(len(TEMPLATES))
        examples.append(
            Example(
                prompt=TEMPLATES[t].format(country=f"[[SUBJ:{country}]]"),  # role SUBJ: the subject's last token
                counterfactual=TEMPLATES[t].format(country=f"[[SUBJ:{other}]]"),
                answers=(" " + capital,),
                wrong_answers=(" " + other_capital,),
                label=i,
                meta={"country": country, "capital": capital, "template": t, "counterfactual_country": other},
            )
        )
    return Dataset(
        "facts",
        tuple(examples),
        description="Country -> capital recall; label = the country's index in vocab.COUNTRIES.",
        params={"task": "facts", "n": n, "seed": seed, "tokenizer": tokenizer_name(tokenizer)},
    )

