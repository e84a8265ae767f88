"""Indirect object identification (Wang et al. 2022).

"When Mary and John went to the store, John gave a drink to" -> " Mary" (the indirect object, IO),
against " John" (the subject, S). ABBA: the IO is named first; BABA: the subject is named first.
Roles (positions by role, data/roles.py): IO, S1 (the subject's first mention), S2 (its second, the
giver), END; in a counterfactual, the names in the same slots.
"""

from __future__ import annotations

import random
from typing import Any

from entoscope.data.examples import Dataset, Example
from entoscope.data.tasks import vocab
from entoscope.data.tasks._common import TaskParamError, single_tokens, tokenizer_name

# {a} and {b} are the two names introduced, {c} the subject who gives; every name follows a space.
TEMPLATES: tuple[str, ...] = (
    "When {a} and {b} went to the {place}, {c} gave a {object} to",
    "Then, {a} and {b} went to the {place}. {c} gave a {object} to",
    "After {a} and {b} went to the {place}, {c} gave a {object} to",
    "While {a} and {b} were working at the {place}, {c} gave a {object} to",
    "When {a} and {b} arrived at the {place}, {c} handed a {object} to",
    "Then, {a} and {b} had a long day at the {place}. {c} gave a {object} to",
)
ORDERS = ("ABBA", "BABA")
COUNTERFACTUALS = ("abc", "swap", None)


def _fill(t: int, order: str, io: str, s: str, giver: str, slots: dict[str, str]) -> str:
    """The prompt, its names marked with their roles: IO, S1 (the subject's first mention), S2 (the giver)."""
    a, b = (f"[[IO:{io}]]", f"[[S1:{s}]]") if order == "ABBA" else (f"[[S1:{s}]]", f"[[IO:{io}]]")
    return TEMPLATES[t].format(a=a, b=b, c=f"[[S2:{giver}]]", **slots)


def ioi(
    n: int = 64, seed: int = 0, tokenizer: Any = None, counterfactual: str | None = "abc"
) -> Dataset:
    """IOI prompts, half ABBA (label 0) and half BABA (label 1), in a seeded random order.

    counterfactual: "abc" replaces the three names by three other distinct names (the ABC
    distribution of Wang et al.); "swap" swaps the IO and the subject, so the answer flips;
    None gives no counterfactual.
    """
    if counterfactual not in COUNTERFACTUALS:
        raise TaskParamError(f"ioi: counterfactual must be one of {COUNTERFACTUALS}, got {counterfactual!r}")
    if n < 0:
        raise TaskParamError(f"ioi: n must be >= 0, got {n}")
    names = single_tokens("ioi", "names", vocab.NAMES, tokenizer, 5 if counterfactual == "abc" else 2)
    places = single_tokens("ioi", "places", vocab.PLACES, tokenizer, 1)
    objects = single_tokens("ioi", "objects", vocab.OBJECTS, tokenizer, 1)

    rng = random.Random(seed)
    orders = [ORDERS[i % 2] for i in range(n - n % 2)] + ([rng.choice(ORDERS)] if n % 2 else [])
    rng.shuffle(orders)
    examples = []
    for order in orders:
        t = rng.randrange(len(TEMPLATES))
        io, s = rng.sample(names, 2)
        place, obj = rng.choice(places), rng.choice(objects)
        slots = {"place": place, "object": obj}
        meta: dict[str, Any] = {"io": io, "s": s, "template": t, "order": order, "place": place, "object": obj}
        if counterfactual == "abc":
            x, y, z = rng.sample([m for m in names if m not in (io, s)], 3)
            cf = _fill(t, order, x, y, z, slots)
            meta["counterfactual_names"] = [x, y, z]
        elif counterfactual == "swap":
            cf = _fill(t, order, s, io, io, slots)
        else:
            cf = None
        examples.append(
            Example(
                prompt=_fill(t, order, io, s, s, slots),
                counterfactual=cf,
                answers=(" " + io,),
                wrong_answers=(" " + s,),
                label=ORDERS.index(order),
                meta=meta,
            )
        )
    return Dataset(
        "ioi",
        tuple(examples),
        description="Indirect object identification (Wang et al. 2022); label 0 = ABBA, 1 = BABA.",
        params={"task": "ioi", "n": n, "seed": seed, "counterfactual": counterfactual,
                "tokenizer": tokenizer_name(tokenizer)},
    )


def swapped(example: Example) -> Example:
    """An ioi example with its two names swapped in every slot (the IO becomes the subject and the giver): the
    answer flips. Its prompt carries the role markers (IO, S1, S2)."""
    m = example.meta
    slots = {"place": m["place"], "object": m["object"]}
    text = _fill(m["template"], m["order"], m["s"], m["io"], m["io"], slots)
    meta = {**{k: v for k, v in m.items() if k not in ("roles", "cf_roles", "counterfactual_names")},
            "io": m["s"], "s": m["io"]}
    return Example(prompt=text, answers=(" " + m["s"],), wrong_answers=(" " + m["io"],), label=example.label, meta=meta)
