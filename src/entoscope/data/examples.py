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
    if isinstance(value, Mapping):  # a record where a prompt was expected: keep its counterfactual and answers
        raise DataError(f"a {name} must be text or a flat list of token ids, not a record {value!r:.80}",
                        code="prompt_invalid", remedy="pass records (prompt, counterfactual, answers, ...) as "
                        "es.Dataset.from_records([...]), or a list of them as the data; docs/data.md")
    if not ok or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise DataError(f"a {name} must be text or a flat list of token ids, not {value!r:.80}",
                        code="prompt_invalid", remedy=f"give the {name} as a string, or as [id, id, ...]")
    return tuple(int(t) for t in ids)


FIELDS = ("prompt", "counterfactual", "answers", "wrong_answers", "label", "meta")
ALIASES = {"answer": "answers", "wrong_answer": "wrong_answers"}  # one answer, written in the singular
ROLE_FIELDS = ("roles", "cf_roles")  # kept in meta, where Example reads them


def record_fields(record: Any, where: str, code: str = "record_invalid") -> dict[str, Any]:
    """The `Example` fields of one record (a dict as a user writes it, a JSONL line, a CSV row): `answer` /
    `wrong_answer` are one-answer spellings of `answers` / `wrong_answers`, `roles` and `cf_roles` and every
    field that is not an Example's go to `meta` (a record's own `meta` wins a clash). Refused (`code`, naming
    `where`): a record that is not a mapping, one without a prompt, an answer given in both spellings."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where} is a {type(record).__name__}, not a record", code=code,
                        remedy='give a record as {"prompt": "...", "counterfactual": "...", "answers": [" Mary"]}')
    r = dict(record)
    if r.get("prompt") is None:
        raise DataError(f"{where} has no prompt (fields: {', '.join(map(str, r)) or 'none'})", code=code,
                        remedy="every record needs a 'prompt' field")
    for single, plural in ALIASES.items():
        if single in r:
            if plural in r:
                raise DataError(f"{where} gives both {single!r} and {plural!r}", code=code,
                                remedy=f"give one: {plural}: [...] (several) or {single}: \"...\" (one)")
            value = r.pop(single)
            r[plural] = value if isinstance(value, (list, tuple)) else (value,)
    own_meta = r.get("meta") or {}
    if not isinstance(own_meta, Mapping):
        raise DataError(f"{where}: meta must be a mapping, not {own_meta!r:.60}", code=code,
                        remedy="write meta as {...}")
    extra = {k: v for k, v in r.items() if k not in FIELDS}
    fields = {k: v for k, v in r.items() if k in FIELDS}
    fields["meta"] = {**extra, **dict(own_meta)}
    return fields


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
    def from_record(cls, record: Mapping[str, Any], where: str = "the record") -> Example:
        """An example from a record: `to_record()` output, or a dict as a user writes it (`record_fields`:
        `answer` for `answers`, other fields such as `roles` kept in meta)."""
        return cls(**record_fields(record, where))


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
    def from_records(cls, name: str | Sequence[Mapping[str, Any]] = "records",
                     records: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> Dataset:
        """A dataset from records (docs/data.md): `Dataset.from_records(records)` or
        `Dataset.from_records("name", records)`. A record is a dict with `prompt` and, where the task has them,
        `counterfactual`, `answers` (or `answer`), `wrong_answers` (or `wrong_answer`), `label`, `roles`,
        `cf_roles`; other fields land in `meta`; `to_records()` output reads back as it was. A bad record is
        refused with its index (`example 3: ...`)."""
        if records is None and not isinstance(name, str):
            name, records = "records", name
        if not isinstance(name, str) or records is None or isinstance(records, (str, Mapping)):
            raise DataError(f"from_records takes a list of records, not {type(records).__name__}",
                            code="record_invalid", remedy='es.Dataset.from_records([{"prompt": "...", ...}, ...])')
        examples = []
        for i, r in enumerate(records):
            try:
                examples.append(Example.from_record(r, f"record {i}"))
            except DataError as err:
                message = err.message if err.message.startswith(f"record {i}") else f"example {i}: {err.message}"
                raise DataError(message, code=err.code, remedy=err.remedy) from None
        return cls(name, tuple(examples), **kwargs)

    @classmethod
    def from_template(cls, template: str, fills: Sequence[Mapping[str, Any]], *, counterfactual: str | None = None,
                      answers: str | Sequence[str] | None = None, wrong_answers: str | Sequence[str] | None = None,
                      name: str = "template") -> Dataset:
        """Prompts (and counterfactuals, answers, roles) from a template with `{ROLE}` slots, one example per
        fill: `Dataset.from_template("When {IO} and {S} went to the store, {S} gave a drink to",
        [{"IO": "Mary", "S": "John", "C": "Paul"}], counterfactual="When {IO} and {S} went to the store, {C} "
        "gave a drink to", answers=" {IO}", wrong_answers=" {S}")`. Every slot's text becomes a role (a slot
        used more than once: S1, S2, ...). See data/templates.py and docs/data.md."""
        from .templates import from_template

        return from_template(template, fills, counterfactual=counterfactual, answers=answers,
                             wrong_answers=wrong_answers, name=name)
