"""Token roles: which token of each prompt plays which part (IO, S1, S2, END, the start year, ...).

Prompts of different templates put the same role at different positions, so a table column at one
position index can mix tokens of different roles. Sites can name roles instead (`positions: [S1, S2,
END]`, `S2+1`), and each prompt then contributes its own token for that role.

Where roles come from:
- markers in the text: `"When [[IO:Mary]] and [[S1:John]] went ..."` (the markers are removed; the
  role is the last token of the marked text). The built-in tasks write their prompts this way.
- a `roles` field (JSONL/CSV column or `Example(meta={"roles": ...})`): name -> [start, end] character
  span of the prompt text, or name -> token index (an int; negative counts from the end) for a
  prompt given as token ids or to name a token directly. `cf_roles` does the same for the
  counterfactual; without it the counterfactual's markers (or none) are used.
- END, every prompt's last token, is always a role.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import DataError

END = "END"
MARKER = re.compile(r"\[\[([A-Za-z_][A-Za-z0-9_]*):(.*?)\]\]", re.S)
ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OPEN = re.compile(r"\[\[[A-Za-z_][A-Za-z0-9_]*:")


def strip_markers(text: str) -> tuple[str, dict[str, list[int]]]:
    """The text without `[[NAME:text]]` markers, and each marked span's [start, end) in the clean text.

    Refused (role_invalid): a marker that marks no text or only spaces (`[[A:]]`: no token to point at),
    markers inside markers (`[[A:x [[B:y]] z]]`: overlapping roles), an unclosed marker, and a role
    marked twice."""
    out, spans, pos, last = [], {}, 0, 0
    for m in MARKER.finditer(text):
        out.append(text[last:m.start()])
        pos += m.start() - last
        name, inner = m.group(1), m.group(2)
        if name in spans:
            raise DataError(f"role {name!r} is marked twice in {text[:60]!r}", code="role_invalid",
                            remedy="mark each role once per prompt")
        if not inner.strip():
            raise DataError(f"role {name!r} marks no text in {text[:60]!r} ({m.group(0)!r})", code="role_invalid",
                            remedy="put the role's word inside its marker: [[IO:Mary]]")
        if "[[" in inner or "]]" in inner:
            raise DataError(f"role {name!r} overlaps another marker in {text[:60]!r} ({m.group(0)!r})",
                            code="role_invalid", remedy="markers may not nest or overlap: mark each role's "
                            "own word, [[IO:Mary]] and [[S1:John]]")
        spans[name] = [pos, pos + len(inner)]
        out.append(inner)
        pos += len(inner)
        last = m.end()
    out.append(text[last:])
    clean = "".join(out)
    left = OPEN.search(clean)
    if left:
        raise DataError(f"an unclosed role marker {clean[left.start():left.start() + 30]!r} in {text[:60]!r}",
                        code="role_invalid", remedy="close every marker: [[NAME:text]]")
    return clean, spans


def check_spans(roles: Mapping[str, Any], where: str) -> None:
    """Refuse character spans that share characters: two roles cannot mark the same text."""
    spans = sorted((v[0], v[1], k) for k, v in roles.items() if isinstance(v, list))
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise DataError(f"{where}: roles {a} {[a0, a1]} and {b} {[b0, b1]} overlap", code="role_invalid",
                            remedy="give each role its own text: spans (or markers) that do not overlap")


def check_roles(roles: Any, where: str) -> dict[str, Any]:
    """A roles mapping as given by a user: name -> token index or [start, end] character span."""
    if roles is None:
        return {}
    if not isinstance(roles, Mapping):
        raise DataError(f"{where}: roles must map names to positions, not {roles!r:.60}", code="role_invalid",
                        remedy='e.g. roles: {"S2": [31, 36]} (a character span) or {"S2": 7} (a token index)')
    out = {}
    for name, value in roles.items():
        if not isinstance(name, str) or not ROLE_NAME.fullmatch(name) or name == END:
            raise DataError(f"{where}: {name!r} is not a role name (letters, digits, _; END is built in)",
                            code="role_invalid", remedy="name roles like IO, S1, S2, YY")
        span = isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1]
        if not span and not (isinstance(value, int) and not isinstance(value, bool)):
            raise DataError(f"{where}: role {name} = {value!r} is neither a token index nor a [start, end] span",
                            code="role_invalid", remedy="give a token index (int) or a character span [start, end]")
        out[name] = list(value) if span else int(value)
    return out


@dataclass(frozen=True)
class RoleTable:
    """Absolute token position of every role in every prompt: positions [E, R] (-1: the prompt lacks it)."""

    names: tuple[str, ...]
    positions: Tensor

    def index(self, name: str) -> int:
        return self.names.index(name)

    def subset(self, rows: Sequence[int] | Tensor) -> Tensor:
        return self.positions[torch.as_tensor(rows, dtype=torch.long)]

    @property
    def has_named_roles(self) -> bool:
        return len(self.names) > 1


def _span_token(model: Any, text: str, span: list[int], prepend_bos: bool) -> int:
    """Index of the token that holds the last character of `span` (BOS counted when prepended)."""
    start, end = span
    if end > len(text):
        raise DataError(f"a role span {span} reaches past the end of {text[:60]!r} ({len(text)} characters)",
                        code="role_invalid", remedy="give spans inside the prompt text")
    tok = model.tokenizer
    offset = int(prepend_bos)
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if a <= end - 1 < b:
                return i + offset
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer has no offsets
        pass
    return len(tok(text[:end], add_special_tokens=False)["input_ids"]) - 1 + offset


def role_table(model: Any, texts: Sequence[Any], ids: Sequence[Sequence[int]], roles: Sequence[Mapping[str, Any]],
               prepend_bos: bool) -> RoleTable:
    """The RoleTable of prompts (their given text or ids, their token ids, their roles)."""
    names = sorted({n for r in roles for n in r}) + [END]
    pos = torch.full((len(ids), len(names)), -1, dtype=torch.long)
    for e, (text, toks, r) in enumerate(zip(texts, ids, roles)):
        n = len(toks)
        pos[e, -1] = n - 1
        marked: dict[int, str] = {}  # token -> the role whose text ends there (markers and spans)
        for name, value in r.items():
            if isinstance(value, list):
                if not isinstance(text, str):
                    raise DataError(f"prompt {e}: role {name} is a character span, but the prompt is token ids",
                                    code="role_invalid", remedy="give token indices (ints) for token-id prompts")
                p = _span_token(model, text, value, prepend_bos and isinstance(text, str))
            else:
                p = value + n if value < 0 else value
            if not 0 <= p < n:
                raise DataError(f"prompt {e}: role {name} is at token {p}, outside its {n} tokens", code="role_invalid",
                                remedy="check the role's position")
            if isinstance(value, list) and p in marked:
                raise DataError(f"prompt {e}: roles {marked[p]} and {name} both end in token {p} "
                                f"({text[value[0]:value[1]]!r}): one token cannot be two roles", code="role_invalid",
                                remedy="mark whole words: each role's text must end in its own token")
            if isinstance(value, list):
                marked[p] = name
            pos[e, names.index(name)] = p
    return RoleTable(tuple(names), pos)
