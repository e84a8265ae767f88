"""High-level causal models: which output each (base, source) pair should give when one variable of the base
is taken from the source (Geiger et al. 2021: an interchange intervention on the high-level model).

Each model turns a dataset into `Pairs`: the prompts (every prompt once), for each pair its base and source
prompt, the classes the task's output is read over (single tokens, by text), the class the high-level model
predicts under the interchange (`target`), the class it predicts for the base alone (`base_value`), and
each prompt's own value of the variable (`labels`, for the bases that need one: mean difference, probe,
neurons; -1 where unknown).

Built in:
- ioi, variable `io` (which of the two names is the indirect object; Wang et al. 2022). The source of each
  prompt is the same prompt with its two names swapped in every slot (the task's `swap` counterfactual),
  so its IO is the base's subject; the classes are the base's [IO, S] and the high-level model predicts
  S under the interchange (class 1). Both directions are measured: each original prompt is the base of
  one pair and the source of its swap's. Each prompt's value (for the labelled bases) is its IO's name,
  a class per name, so mean_difference and probe span the names' directions.
- facts, variable `country` (the subject whose capital is recalled; Meng et al. 2022's factual recall): the
  source of a prompt is the same template about another country (the task's counterfactual), so the
  high-level model predicts the source's capital under the interchange; the classes are [the base's
  capital, the source's capital] (prediction: class 1). Both directions, as for ioi: each counterfactual
  prompt is also the base of a pair whose source is the original. Each prompt's value is its country's
  index in vocab.COUNTRIES.
- greater_than, variables `yy` (the start year's last two digits) and `decade` (its tens digit; Hanna et al.
  2023): the source is the same sentence with another start year; the high-level model sets the threshold t
  (yy: the source's digits; decade: the source's tens digit with the base's last digit) and predicts a year
  > t. The output is a range, so the classes are the 100 two-digit year tokens grouped into two sets (`sets`:
  0 the years > t, 1 the others) read by their probability mass (runs.by_set: each set's log-sum-exp); the
  prediction is set 0: more mass after t than up to it. One direction only: t lies YEAR_GAP or more years
  after the base's year, so the base's own output is not already the prediction. The base alone's value:
  the set holding most of its own high-level output (its years after its own year, uniform).
- induction, variable `token` (the token to copy, what followed the current token's first occurrence;
  Olsson et al. 2022): the source replaces that token (role B1) with a word of another prompt that the
  sequence lacks; classes [the base's token, the source's], prediction class 1; both directions, as ioi.
- your own: a dataset whose `prompt` is the base, `counterfactual` the source, `answer` the expected
  output under the interchange and `wrong_answers` the other outputs read (the classes are
  [answer, *wrong_answers]); `meta.variable` names the variable, `label` (the base's value) and
  `meta.source_label` (the source's) feed the labelled bases, and `meta.base_class` (an index into the
  classes) is what the base alone should output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.examples import Dataset, Example
from ..errors import DataError

VARIABLES = {"ioi": ("io",), "facts": ("country",), "greater_than": ("yy", "decade"), "induction": ("token",)}
YEAR_GAP = 10  # greater_than: the threshold a source implies is at least this many years after the base's year


@dataclass(frozen=True)
class Pairs:
    prompts: Dataset
    base: np.ndarray  # [P] prompt index of each pair's base (pair k's base is prompt k)
    source: np.ndarray  # [P]
    classes: list[list[str]]  # [P][C] the output tokens read, as text
    target: np.ndarray  # [P] class index predicted under the interchange
    base_value: np.ndarray  # [P] class index predicted for the base alone (-1: unknown)
    labels: np.ndarray  # [n prompts] each prompt's value of the variable (-1: unknown)
    group: np.ndarray  # [P] pairs sharing prompts (split together)
    variable: str
    sets: np.ndarray | None = None  # [P, C] each class column's output set (None: each column its own)

    def __len__(self) -> int:
        return len(self.base)


def task_of(data: Dataset) -> str | None:
    task = (data.params or {}).get("task")
    return str(task) if task else None


def build_pairs(data: Dataset, variable: str | None) -> Pairs:
    """The pairs of `data` under its task's high-level model (or the user's own pairs). A dataset these pairs'
    prompts were saved as (what a run's manifest and a Ray worker get) gives the same pairs back."""
    if (data.params or {}).get(MARK):
        return _unmark(data)
    return _mark(_build(data, variable))


MARK = "interchange_pairs"


def _mark(pairs: Pairs) -> Pairs:
    """The pairs with what defines them written into their prompts' records (meta.pair, meta.value)."""
    examples = []
    for i, e in enumerate(pairs.prompts):
        meta = {**e.meta, "value": int(pairs.labels[i])}
        if i < len(pairs):
            meta["pair"] = {"source": int(pairs.source[i]), "classes": list(pairs.classes[i]),
                            "target": int(pairs.target[i]), "base_value": int(pairs.base_value[i]),
                            "group": int(pairs.group[i]),
                            **({"sets": pairs.sets[i].tolist()} if pairs.sets is not None else {})}
        examples.append(Example(prompt=e.prompt, label=e.label, meta=meta))
    prompts = Dataset(pairs.prompts.name, tuple(examples), description=pairs.prompts.description,
                      params={**dict(pairs.prompts.params or {}), MARK: pairs.variable})
    return Pairs(prompts, pairs.base, pairs.source, pairs.classes, pairs.target, pairs.base_value, pairs.labels,
                 pairs.group, pairs.variable, pairs.sets)


def _unmark(data: Dataset) -> Pairs:
    bases = [e.meta["pair"] for e in data if "pair" in e.meta]
    n = len(bases)
    return Pairs(data, np.arange(n), np.array([b["source"] for b in bases]), [list(b["classes"]) for b in bases],
                 np.array([b["target"] for b in bases]), np.array([b["base_value"] for b in bases]),
                 np.array([int(e.meta.get("value", -1)) for e in data]), np.array([b["group"] for b in bases]),
                 str(data.params[MARK]), np.array([b["sets"] for b in bases]) if bases and "sets" in bases[0] else None)


def _build(data: Dataset, variable: str | None) -> Pairs:
    task = task_of(data)
    if task is not None:
        if task not in VARIABLES:
            raise DataError(f"task {task!r} has no high-level causal model for interchange interventions yet",
                            code="interchange_no_causal_model",
                            remedy="use task ioi (variable io), facts (country), greater_than (yy, decade) or "
                            "induction (token), or give your own pairs: "
                            "prompt (base), "
                            "counterfactual (source), answer (expected output) and wrong_answers (docs/interchange.md)")
        known = VARIABLES[task]
        if variable is not None and variable not in known:
            raise DataError(f"task {task!r} has no variable {variable!r}", code="interchange_variable",
                            remedy=f"its variables: {', '.join(known)}")
        if task == "greater_than":
            return _greater_than(data, variable or "yy")
        return {"ioi": _ioi, "facts": _facts, "induction": _induction}[task](data)
    return _own(data, variable)


def _ioi(data: Dataset) -> Pairs:
    from ..data.tasks.ioi import swapped

    n = len(data)
    if n < 4:
        raise DataError(f"interchange on ioi needs at least 4 prompts, got {n}", code="interchange_too_few",
                        remedy="use n: 16 or more")
    originals = [Example(prompt=e.prompt, label=e.label, meta={k: v for k, v in e.meta.items()
                                                              if k not in ("cf_roles", "counterfactual_names")})
                 for e in data]
    swaps = [swapped(e) for e in data]
    examples = originals + swaps
    names = sorted({e.meta["io"] for e in examples})
    labels = np.array([names.index(e.meta["io"]) for e in examples])
    base = np.arange(2 * n)
    source = np.concatenate([np.arange(n) + n, np.arange(n)])
    classes = [[" " + e.meta["io"], " " + e.meta["s"]] for e in examples]
    prompts = Dataset(data.name, tuple(examples), description=data.description, params=dict(data.params or {}))
    return Pairs(prompts, base, source, classes, np.ones(2 * n, dtype=np.int64), np.zeros(2 * n, dtype=np.int64),
                 labels, base % n, "io")


def _facts(data: Dataset) -> Pairs:
    from ..data.tasks import vocab

    n = len(data)
    if n < 4:
        raise DataError(f"interchange on facts needs at least 4 prompts, got {n}", code="interchange_too_few",
                        remedy="use n: 16 or more")
    countries = [c for c, _ in vocab.COUNTRIES]
    capital = dict(vocab.COUNTRIES)
    originals = [Example(prompt=e.prompt, label=e.label,
                         meta={"country": e.meta["country"],
                               **({"roles": e.meta["roles"]} if "roles" in e.meta else {})}) for e in data]
    others = [Example(prompt=e.counterfactual, label=countries.index(e.meta["counterfactual_country"]),
                      meta={"country": e.meta["counterfactual_country"],
                            **({"roles": e.meta["cf_roles"]} if "cf_roles" in e.meta else {})}) for e in data]
    examples = originals + others
    base = np.arange(2 * n)
    source = np.concatenate([np.arange(n) + n, np.arange(n)])
    classes = [[" " + capital[examples[b].meta["country"]], " " + capital[examples[s].meta["country"]]]
               for b, s in zip(base, source)]
    labels = np.array([countries.index(e.meta["country"]) for e in examples])
    prompts = Dataset(data.name, tuple(examples), description=data.description, params=dict(data.params or {}))
    return Pairs(prompts, base, source, classes, np.ones(2 * n, dtype=np.int64), np.zeros(2 * n, dtype=np.int64),
                 labels, base % n, "country")


def _threshold(variable: str, base_yy: int, source_yy: int) -> int:
    """The start year's last two digits the high-level model sets under the interchange: the source's (yy), or
    the source's decade with the base's last digit (decade)."""
    return source_yy if variable == "yy" else 10 * (source_yy // 10) + base_yy % 10


def _year_pair(yy: int, variable: str, rng: np.random.Generator) -> tuple[int, int]:
    """(base yy, source yy), one of them `yy`: the threshold the source implies is YEAR_GAP or more years after
    the base's and leaves a greater year (<= 97); for decade the last digits differ too. `yy` is the base where
    it can be (a source it can be paired with exists), else the source."""
    from ..data.tasks.greater_than import START_YY

    def ok(b: int, s: int) -> bool:
        t = _threshold(variable, b, s)
        return b + YEAR_GAP <= t <= 97 and (variable == "yy" or s % 10 != b % 10)

    as_base = [(yy, s) for s in START_YY if ok(yy, s)]
    options = as_base or [(b, yy) for b in START_YY if ok(b, yy)]
    return options[int(rng.integers(len(options)))]


def _greater_than(data: Dataset, variable: str) -> Pairs:
    from ..data.tasks import vocab
    from ..data.tasks.greater_than import sentence

    n = len(data)
    if n < 4:
        raise DataError(f"interchange on greater_than needs at least 4 prompts, got {n}", code="interchange_too_few",
                        remedy="use n: 16 or more")
    rng = np.random.default_rng(int((data.params or {}).get("seed", 0)))
    bases, sources, thresholds = [], [], []
    for e in data:
        m = e.meta
        b, s = _year_pair(int(m["yy"]), variable, rng)
        for yy, out in ((b, bases), (s, sources)):
            out.append(Example(prompt=sentence(int(m["template"]), m["noun"], int(m["century"]), yy, marked=True),
                               label=yy, meta={"century": m["century"], "yy": yy}))
        thresholds.append(_threshold(variable, b, s))
    examples = bases + sources
    value = (lambda yy: yy) if variable == "yy" else (lambda yy: yy // 10)
    labels = np.array([value(int(e.meta["yy"])) for e in examples])
    t = np.array(thresholds)
    years = np.arange(100)
    sets = np.where(years[None, :] > t[:, None], 0, 1)  # set 0: the years greater than the threshold
    base_yy = np.array([int(e.meta["yy"]) for e in bases])
    base_value = np.where(2 * (99 - t) > 99 - base_yy, 0, 1)  # the base's years, uniform, mostly above t?
    prompts = Dataset(data.name, tuple(examples), description=data.description, params=dict(data.params or {}))
    return Pairs(prompts, np.arange(n), np.arange(n) + n, [list(vocab.TWO_DIGITS)] * n, np.zeros(n, dtype=np.int64),
                 base_value.astype(np.int64), labels, np.arange(n), variable, sets)


def _induction(data: Dataset) -> Pairs:
    from ..data.tasks.induction import _marked

    n = len(data)
    if n < 4:
        raise DataError(f"interchange on induction needs at least 4 prompts, got {n}", code="interchange_too_few",
                        remedy="use n: 16 or more")
    rng = np.random.default_rng(int((data.params or {}).get("seed", 0)))
    seen = sorted({w for e in data for w in e.meta["words"]})  # words the task found single tokens
    originals, others = [], []
    for e in data:
        words, k = list(e.meta["words"]), int(e.meta["k"])
        pool = [w for w in seen if w not in words]
        if not pool:
            raise DataError("induction prompts share all their words: no other token to copy",
                            code="interchange_too_few", remedy="use more prompts (n: 16 or more)")
        swapped = words[:k] + [pool[int(rng.integers(len(pool)))]] + words[k + 1:]
        originals.append(Example(prompt=e.prompt, meta={"words": words, "k": k, "roles": e.meta["roles"]}))
        others.append(Example(prompt=_marked(swapped, swapped[:k]), meta={"words": swapped, "k": k}))
    examples = originals + others
    copied = [e.meta["words"][e.meta["k"]] for e in examples]
    labels = np.array([seen.index(w) for w in copied])
    base = np.arange(2 * n)
    source = np.concatenate([np.arange(n) + n, np.arange(n)])
    classes = [[" " + copied[b], " " + copied[s]] for b, s in zip(base, source)]
    prompts = Dataset(data.name, tuple(examples), description=data.description, params=dict(data.params or {}))
    return Pairs(prompts, base, source, classes, np.ones(2 * n, dtype=np.int64), np.zeros(2 * n, dtype=np.int64),
                 labels, base % n, "token")


def _own(data: Dataset, variable: str | None) -> Pairs:
    n = len(data)
    if n < 4:
        raise DataError(f"interchange needs at least 4 pairs, got {n}", code="interchange_too_few",
                        remedy="give more pairs")
    names = set()
    for i, e in enumerate(data):
        if e.counterfactual is None or not e.answers:
            raise DataError(f"pair {i} needs a counterfactual (the source) and an answer (the expected output under "
                            "the interchange)", code="interchange_pairs",
                            remedy="give prompt (base), counterfactual (source), answer and wrong_answers per record")
        if not e.wrong_answers:
            raise DataError(f"pair {i} has no wrong_answers: the output is read over [answer, *wrong_answers]",
                            code="interchange_pairs", remedy="list the other outputs (at least the base's own)")
        names.add(e.meta.get("variable"))
    names.discard(None)
    if len(names) > 1:
        raise DataError(f"the pairs name several variables: {sorted(names)}", code="interchange_variable",
                        remedy="give one variable's pairs per run")
    name = variable or (names.pop() if names else "variable")
    bases = [Example(prompt=e.prompt, label=e.label, meta={k: v for k, v in e.meta.items() if k == "roles"})
             for e in data]
    sources = [Example(prompt=e.counterfactual, meta={"roles": e.meta["cf_roles"]} if "cf_roles" in e.meta else {})
               for e in data]
    classes = [[e.answers[0], *e.wrong_answers] for e in data]
    if len({len(c) for c in classes}) != 1:
        raise DataError("the pairs read different numbers of outputs", code="interchange_pairs",
                        remedy="give every pair the same number of wrong_answers")
    labels = np.array([-1 if e.label is None else int(e.label) for e in data]
                      + [int(e.meta.get("source_label", -1)) for e in data])
    base_value = np.array([int(e.meta.get("base_class", -1)) for e in data])
    prompts = Dataset(data.name, tuple(bases + sources), description=data.description, params=dict(data.params or {}))
    return Pairs(prompts, np.arange(n), np.arange(n) + n, classes, np.zeros(n, dtype=np.int64), base_value, labels,
                 np.arange(n), name)


def split(pairs: Pairs, test_share: float, seed: int) -> np.ndarray:
    """[P] True for held-out pairs: a seeded share of the groups (pairs sharing a prompt stay together, so no
    held-out prompt is seen in training, as base or source)."""
    groups = np.unique(pairs.group)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(groups))
    k = min(len(groups) - 1, max(1, int(round(test_share * len(groups)))))
    held = set(groups[order[:k]].tolist())
    return np.array([g in held for g in pairs.group])
