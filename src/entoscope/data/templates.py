"""Datasets from a template with `{ROLE}` slots: prompts, counterfactuals, answers and token roles in one call.

    Dataset.from_template("When {IO} and {S} went to the store, {S} gave a drink to",
                          [{"IO": "Mary", "S": "John", "C": "Paul"}, ...],
                          counterfactual="When {IO} and {S} went to the store, {C} gave a drink to",
                          answers=" {IO}", wrong_answers=" {S}")

One example per fill (a dict: slot -> text). Each slot's text in the prompt becomes a role (data/roles.py:
the role is the last token of that text), named after the slot; a slot used more than once names one role
per use, numbered in order (`{S}` twice: S1 and S2), as the built-in IOI task names them. The roles are
written as `[[ROLE:text]]` markers, which `Example` turns into character spans, so positions such as `S2`
or `IO+1` work in `Sites` exactly as on the built-in tasks.

The counterfactual is another template over the same fill. When it has as many slots as the prompt's, its
k-th slot plays the prompt's k-th role (the counterfactual's token at the same place in the sentence: above,
C's token is the counterfactual's S2); otherwise its roles are named from its own slots by the same rule.
`answers` / `wrong_answers` are templates too (mind the leading space: " {IO}"), filled without roles.
A fill's `label` is the example's label; every fill value is kept in the example's meta.

Refused (`template_invalid`): a slot that is not a plain name (`{0}`, `{a.b}`, `{x:>3}`), unbalanced braces,
role markers written in a template, role names that clash (`{S}` twice beside `{S1}`), fill values that are not
text or integers or that hold `[[`/`]]`; (`template_fill_missing`): a fill without a slot's value.
"""

from __future__ import annotations

import numbers
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DataError
from .examples import Dataset, Example
from .roles import END, ROLE_NAME

Piece = tuple[str, str | None]  # (literal text, the slot after it or None)


def _pieces(template: Any, what: str) -> list[Piece]:
    if not isinstance(template, str):
        raise DataError(f"the {what} template must be text, not {template!r:.60}", code="template_invalid",
                        remedy='e.g. "When {IO} and {S} went to the store, {S} gave a drink to"')
    if "[[" in template or "]]" in template:
        raise DataError(f"the {what} template {template[:60]!r} holds a role marker ([[ or ]])", code="template_invalid",
                        remedy="write roles as {SLOT} in a template (markers are for prompts written out in full)")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DataError(f"the {what} template {template[:60]!r} cannot be read ({err})", code="template_invalid",
                        remedy="write slots as {NAME}; a literal brace is {{ or }}") from None
    out: list[Piece] = []
    for literal, slot, spec, conversion in parsed:
        if slot is not None and (not ROLE_NAME.fullmatch(slot) or spec or conversion):
            raise DataError(f"the {what} template {template[:60]!r} has slot {{{slot}{'!' + conversion if conversion else ''}"
                            f"{':' + spec if spec else ''}}}, not a plain name", code="template_invalid",
                            remedy="name each slot with letters, digits and _ ({IO}, {S}, {YEAR}); no format specs")
        if slot == END:
            raise DataError(f"the {what} template uses {{{END}}}: END is every prompt's last token, a built-in role",
                            code="template_invalid", remedy="give the slot another name")
        out.append((literal, slot))
    return out


def _roles(slots: list[str], what: str) -> list[str]:
    """A role name per use of a slot: the slot's name, or NAME1, NAME2, ... for a slot used more than once."""
    count, seen = Counter(slots), Counter[str]()
    names = []
    for slot in slots:
        seen[slot] += 1
        names.append(slot if count[slot] == 1 else f"{slot}{seen[slot]}")
    clash = sorted(n for n, c in Counter(names).items() if c > 1)
    if clash:
        raise DataError(f"the {what} template names role {clash[0]} twice (a slot used more than once is numbered: "
                        f"{{S}} twice gives S1 and S2)", code="template_invalid",
                        remedy=f"rename the slot {clash[0]} (or the slot numbered into it)")
    return names


def _value(fill: Mapping[str, Any], slot: str, index: int, what: str) -> str:
    if slot not in fill:
        raise DataError(f"fill {index} has no value for {{{slot}}} (used in the {what}; it gives "
                        f"{', '.join(map(str, fill)) or 'nothing'})", code="template_fill_missing",
                        remedy=f"give every fill a {slot!r}")
    value = fill[slot]
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise DataError(f"fill {index}: {slot} = {value!r:.60} is neither text nor an integer", code="template_invalid",
                        remedy="give slot values as text (\"Mary\") or integers (1732)")
    text = str(value)
    if "[[" in text or "]]" in text:
        raise DataError(f"fill {index}: {slot} = {text[:40]!r} holds [[ or ]] (role markers)", code="template_invalid",
                        remedy="slot values are plain text")
    return text


def _fill(pieces: list[Piece], roles: list[str] | None, fill: Mapping[str, Any], index: int, what: str) -> str:
    out, k = [], 0
    for literal, slot in pieces:
        out.append(literal)
        if slot is None:
            continue
        text = _value(fill, slot, index, what)
        out.append(text if roles is None else f"[[{roles[k]}:{text}]]")
        k += 1
    return "".join(out)


def _answer_templates(value: str | Sequence[str] | None, what: str) -> list[list[Piece]]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [_pieces(v, what) for v in items]


def from_template(template: str, fills: Sequence[Mapping[str, Any]], *, counterfactual: str | None = None,
                  answers: str | Sequence[str] | None = None, wrong_answers: str | Sequence[str] | None = None,
                  name: str = "template") -> Dataset:
    """A `Dataset` with one example per fill (the module docstring says how roles are named)."""
    pieces = _pieces(template, "prompt")
    roles = _roles([s for _, s in pieces if s is not None], "prompt")
    cf_pieces = cf_roles = None
    if counterfactual is not None:
        cf_pieces = _pieces(counterfactual, "counterfactual")
        cf_slots = [s for _, s in cf_pieces if s is not None]
        cf_roles = roles if len(cf_slots) == len(roles) else _roles(cf_slots, "counterfactual")
    answer_pieces = _answer_templates(answers, "answers")
    wrong_pieces = _answer_templates(wrong_answers, "wrong answers")
    if isinstance(fills, (str, Mapping)) or not isinstance(fills, Sequence):
        raise DataError(f"fills must be a list of dicts (slot -> text), not {type(fills).__name__}",
                        code="template_invalid", remedy='e.g. [{"IO": "Mary", "S": "John"}, ...]')
    examples = []
    for i, fill in enumerate(fills):
        if not isinstance(fill, Mapping):
            raise DataError(f"fill {i} is a {type(fill).__name__}, not a dict of slot values", code="template_invalid",
                            remedy='e.g. {"IO": "Mary", "S": "John"}')
        try:
            examples.append(Example(
                _fill(pieces, roles, fill, i, "prompt"),
                counterfactual=None if cf_pieces is None else _fill(cf_pieces, cf_roles, fill, i, "counterfactual"),
                answers=tuple(_fill(p, None, fill, i, "answers") for p in answer_pieces),
                wrong_answers=tuple(_fill(p, None, fill, i, "wrong answers") for p in wrong_pieces),
                label=fill.get("label"), meta={k: v for k, v in fill.items() if k != "label"}))
        except DataError as err:
            message = err.message if err.message.startswith(f"fill {i}") else f"fill {i}: {err.message}"
            raise DataError(message, code=err.code, remedy=err.remedy) from None
    params = {"template": template, "counterfactual": counterfactual}
    return Dataset(name, tuple(examples), params={k: v for k, v in params.items() if v is not None})
