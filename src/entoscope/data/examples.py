"""The records every dataset is made of: one `Example` per prompt, a `Dataset` of them.

An example holds text (or token ids) and, where the task has them, a counterfactual prompt of the
same token length, the answer tokens, the competing ("wrong") answer tokens and a label. Answers are
kept as text (with their leading space, e.g. " Mary") or as token ids; they are turned into ids by
the model's tokenizer at run time, where an answer that is not one token is refused.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError
from .roles import check_roles, check_spans, strip_markers

Text = str | tuple[int, ...]
Token = str | int


def _text(value: Any, name: str) -> Text:
    """A prompt as given: text, or a flat sequence of token ids (ints)."""
    if isinstance(value, str):
        return value
    ok = isinstance(value, (list, tuple)) or hasattr(value, "tolist") and getattr(value, "ndim", 1) == 1
    ids = list(value.tolist() if hasattr(value, "tolist") else value) if ok else []
    if not ok or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise DataError(f"a {name} must be text or a flat list of token ids, not {value!r:.80}",
                        code="prompt_invalid", remedy=f"give the {name} as a string, or as [id, id, ...]")
    return tuple(int(t) for t in ids)


@dataclass(frozen=True)
class Example:
    """One prompt of a dataset.

    prompt:         text, or a tuple of token ids (then used as given: no BOS is added).
    counterfactual: the corrupted/counterfactual prompt paired with `prompt`, or None.
    answers:        the correct next token(s); metrics over a set (e.g. greater-than's years) use all.
    wrong_answers:  the competing next token(s) (logit difference = mean logit of answers minus mean
                    logit of wrong answers; probability difference = sum minus sum).
    label:          a prompt-level label for probing (class or number), or None.
    meta:           task-specific facts (names, template id, period, ...), JSON-serialisable.
    """

    prompt: Text
    counterfactual: Text | None = None
    answers: tuple[Token, ...] = ()
    wrong_answers: tuple[Token, ...] = ()
    label: int | float | str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("answers", "wrong_answers"):
            value = getattr(self, name)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                value = (value,)
            elif value is None:
                value = ()
            elif not isinstance(value, (list, tuple)):
                raise DataError(f"{name} must be a token (text or id) or a list of them, not {value!r}",
                                code="answer_invalid", remedy='e.g. answers: [" Mary"] or answers: [42]')
            for t in value:
                if isinstance(t, bool) or not isinstance(t, (str, numbers.Integral)):
                    raise DataError(f"{name} holds {t!r}, which is neither text nor a token id",
                                    code="answer_invalid", remedy='e.g. answers: [" Mary"] or answers: [42]')
            object.__setattr__(self, name, tuple(t if isinstance(t, str) else int(t) for t in value))
        meta = dict(self.meta or {})
        for name, key in (("prompt", "roles"), ("counterfactual", "cf_roles")):
            value = getattr(self, name)
            if value is None and name == "counterfactual":
                continue
            value = _text(value, name)
            roles = check_roles(meta.get(key), name)
            if isinstance(value, str) and "[[" in value:
                value, marked = strip_markers(value)
                twice = sorted(set(roles) & set(marked))
                if twice:
                    raise DataError(f"{name}: role {twice[0]} is given twice (in {key} and as a marker)",
                                    code="role_invalid", remedy="give each role once: a marker or a roles entry")
                roles = {**roles, **marked}
            check_spans(roles, name)
            if roles:
                meta[key] = roles
            object.__setattr__(self, name, value)
        object.__setattr__(self, "meta", meta)

    @property
    def roles(self) -> dict[str, Any]:
        """The prompt's roles (docs: data/roles.py): name -> character span [start, end] or token index."""
        return dict(self.meta.get("roles", {}))

    @property
    def cf_roles(self) -> dict[str, Any]:
        """The counterfactual's roles (falls back to the prompt's when its has none and lengths agree)."""
        return dict(self.meta.get("cf_roles", {}))

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the manifest keeps the data a run used)."""
        def plain(v: Any) -> Any:
            return list(v) if isinstance(v, tuple) else v

        return {
            "prompt": plain(self.prompt),
            "counterfactual": plain(self.counterfactual),
            "answers": list(self.answers),
            "wrong_answers": list(self.wrong_answers),
            "label": self.label,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Example:
        known = {"prompt", "counterfactual", "answers", "wrong_answers", "label", "meta"}
        return cls(**{k: v for k, v in record.items() if k in known})


@dataclass(frozen=True)
class Dataset(Sequence[Example]):
    """A named, ordered collection of examples (what every operation runs over)."""

    name: str
    examples: tuple[Example, ...]
    description: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)  # how it was made (task, n, seed, ...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "examples", tuple(self.examples))

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return Dataset(self.name, self.examples[index], self.description, self.params)
        return self.examples[index]

    @property
    def has_counterfactuals(self) -> bool:
        return bool(self.examples) and all(e.counterfactual is not None for e in self.examples)

    @property
    def has_answers(self) -> bool:
        return bool(self.examples) and all(e.answers for e in self.examples)

    @property
    def has_labels(self) -> bool:
        return bool(self.examples) and all(e.label is not None for e in self.examples)

    def to_records(self) -> list[dict[str, Any]]:
        return [e.to_record() for e in self.examples]

    @classmethod
    def from_records(cls, name: str, records: Sequence[Mapping[str, Any]], **kwargs: Any) -> Dataset:
        """A dataset from to_records() output; a bad record is refused with its index."""
        examples = []
        for i, r in enumerate(records):
            try:
                examples.append(Example.from_record(r))
            except DataError as err:
                raise DataError(f"example {i}: {err.message}", code=err.code, remedy=err.remedy) from None
        return cls(name, tuple(examples), **kwargs)
