"""Takeaways made of claims: every number a takeaway states is a cell of a table saved beside it, and every
qualifier it uses ("most", "strongest", "above 0", ...) is one of the rules below applied to those cells.
The rules are written for readers in docs/pages.md ("Words that follow numbers"); this is their one home.

A takeaway is built with `TakeawayBuilder`: plain words (`say`), quoted cells (`quote`: the row's name,
its value, its interval and its q where the table has them), counts of rows (`count`), columns that are
the same on every row (`constant`: the number of prompts, the interval level), settings of the run
(`setting`), and qualifiers (`qualify`: the word, the rule, the claims it judges). `build()` gives a
`Takeaway`: a `str` (what pages show) that also holds its claims, each with the span of text it wrote,
so a test (tests/test_page_claims.py) can read every number back from the tables and every word
against its rule. A Result saves them as takeaway.json beside table.csv.

A takeaway has a lead and details (docs/pages.md, "A takeaway first"): `end_lead()` marks where the lead ends,
after one or two plain sentences saying what held (or that nothing did); `Takeaway.lead` is the text up to
the mark, `Takeaway.details` the rest (the figures and caveats), and the whole text stays the takeaway
(notebooks, `print`), its claims' spans valid in it. takeaway.json records the mark as `lead_end`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

MOST = 0.5  # "most": a share (or a normalised effect, a fraction of the metric) at or above one half ...
# ... whose interval's lower end is above one half too, so the data carry it, not only the point estimate.


# ----------------------------------------------------------------------------- the rules

def finite(*xs: Any) -> bool:
    return all(x is not None and isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(float(x))
               for x in xs)


def most(value: float, low: float | None = None) -> bool:
    """"most" of a whole: an estimate >= 0.5 whose interval's lower end is > 0.5 (no interval, NaN: not
    carried); an exact share of the run's own prompts (low None): more than half."""
    if not finite(value):
        return False
    if low is None:
        return value > MOST
    return finite(low) and value >= MOST and low > MOST


CONTROL_MARGIN = 0.1  # a head "passes its control": score - control (per prompt) has its interval's lower end above this


def clears(low: float | None, margin: float = CONTROL_MARGIN) -> bool:
    """An effect whose interval lies wholly above `margin` (a head's score over its control: at least that share
    of its attention moves onto its targets because the tokens repeat, and the data carry it)."""
    return finite(low) and float(low) > margin  # type: ignore[arg-type]


def excludes_zero(low: float | None, high: float | None) -> bool:
    return finite(low, high) and (low > 0 or high < 0)  # type: ignore[operator]


def magnitude(low: float, high: float) -> tuple[float, float]:
    """The range of |x| over an interval [low, high]."""
    lo = 0.0 if low <= 0 <= high else min(abs(low), abs(high))
    return lo, max(abs(low), abs(high))


def separated(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """"strongest": the top row's |value| interval lies wholly above the runner-up's."""
    if not finite(*first, *second):
        return False
    return magnitude(*first)[0] > magnitude(*second)[1]


def excludes_zero_rows(frame: Any, stem: str) -> np.ndarray:
    """Rows whose `<stem>` interval excludes 0 (the candidates a screen with no discovery names)."""
    low, high = frame[f"{stem}_ci_low"].to_numpy(float), frame[f"{stem}_ci_high"].to_numpy(float)
    return (low > 0) | (high < 0)


def prompts_for_discovery(cells: int, fdr: float) -> int:
    """The fewest prompts on which one cell among `cells` can be a Benjamini-Hochberg discovery on its own:
    the sign-flip test's smallest p, 2^-(n-1), must reach fdr / cells (docs/statistics.md)."""
    return 1 + max(0, math.ceil(math.log2(max(1, cells) / fdr) - 1e-12))


def distinguished(change: float, random_change: float, diff_low: float | None, diff_high: float | None) -> bool:
    """A causal check singles out the probe's direction when removing it moves the metric further than
    removing a random direction (|change| > |random change|) and the interval of the paired difference
    (probe - random, per prompt) excludes 0."""
    return finite(change, random_change) and abs(change) > abs(random_change) and excludes_zero(diff_low, diff_high)


# ----------------------------------------------------------------------------- claims

@dataclass
class Claim:
    """One statement of a takeaway: `text` is the span it wrote, starting at `start` in the takeaway.

    type:    quote (a cell: value, low, high, q), count (rows of `column` meeting `condition`: value of
             total; condition 'true' for a boolean column, 'excludes_zero' for rows whose `column` interval
             excludes 0, a comparison such as '>=1'; '...&kind=induction': among the rows of that kind only,
             which are then the total), limit (the fewest prompts a cell among `total` needs to be a discovery on its own
             at the run's stats.fdr: value), constant (a column equal on every row: value), setting (a config value of the run,
             `column` a dotted path in manifest.json's config), qualifier (`word`, by `rule`, judging the
             claims at `refs`; `holds` is what the rule gave).
    source:  the file the numbers are read from, relative to where the takeaway is saved (table.csv,
             summary.json, scores.csv; a report section's: patching/example1/table.csv).
    row:     the id columns and values that select the row (None: a JSON file's top level, or a constant).
    """

    type: str
    text: str
    start: int = -1
    source: str = "table.csv"
    row: dict[str, Any] | None = None
    column: str | None = None
    value: float | None = None
    low: float | None = None
    high: float | None = None
    q: float | None = None
    fmt: str = ".2f"
    condition: str | None = None
    total: int | None = None
    word: str | None = None
    rule: str | None = None
    holds: bool | None = None
    refs: list[int] = field(default_factory=list)


class Takeaway(str):
    """The text of a takeaway (a plain `str` to every reader) with the claims it is made of, and where its
    lead ends (`lead_end`, an offset in the text; None: the whole text is the lead)."""

    claims: tuple[Claim, ...]
    lead_end: int | None

    def __new__(cls, text: str = "", claims: tuple[Claim, ...] | list[Claim] = (),
                lead_end: int | None = None) -> Takeaway:
        obj = super().__new__(cls, text)
        obj.claims = tuple(claims)
        obj.lead_end = None if lead_end is None or lead_end >= len(text) else int(lead_end)
        return obj

    @property
    def lead(self) -> str:
        """The text up to the lead's end (one or two plain sentences: what held); the whole text when unmarked."""
        return split_lead(self)[0]

    @property
    def details(self) -> str:
        """The text after the lead (its figures and caveats); '' when unmarked."""
        return split_lead(self)[1]

    def rebased(self, prefix: str) -> Takeaway:
        """The same takeaway with its sources relative to the folder above (prefix: the run's sub-folder)."""
        return Takeaway(str(self), [replace(c, source=f"{prefix}/{c.source}") for c in self.claims], self.lead_end)

    def to_dict(self) -> dict[str, Any]:
        return {"text": str(self), "lead_end": self.lead_end, "claims": [asdict(c) for c in self.claims]}


def split_lead(text: str) -> tuple[str, str]:
    """(lead, details) of a takeaway: a `Takeaway`'s parts at its lead's end; any other text is all lead."""
    end = getattr(text, "lead_end", None)
    if end is None:
        return str(text).strip(), ""
    return str(text)[:end].strip(), str(text)[end:].strip()


def _leading_space(text: str) -> int:
    return len(text) - len(text.lstrip())


def takeaway_json(entries: list[dict[str, Any]]) -> str:
    return json.dumps(entries, indent=1, default=_plain)


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return str(v)


def write_takeaways(path: Path, entries: list[tuple[str, str]]) -> None:
    """Save (page, takeaway) pairs as JSON (text and claims; a plain string has no claims)."""
    rows = [{"page": page, **(t.to_dict() if isinstance(t, Takeaway) else {"text": str(t), "lead_end": None,
                                                                          "claims": []})}
            for page, t in entries if t]
    path.write_text(takeaway_json(rows), encoding="utf-8")


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt_number(v: float, fmt: str) -> str:
    return format(int(round(v)), fmt) if fmt.endswith("d") else format(v, fmt)


def q_text(q: float) -> str:
    """q as a reader reads it: two significant digits, '< 0.001' below that."""
    return "q < 0.001" if q < 0.001 else f"q = {q:.2g}"


class TakeawayBuilder:
    """Builds a `Takeaway` piece by piece; `source` and `key` are the defaults of every quote."""

    def __init__(self, source: str = "table.csv", key: str | tuple[str, ...] = "site") -> None:
        self.source, self.key = source, key
        self._parts: list[str] = []
        self._claims: list[Claim] = []
        self._length = 0
        self._lead_end: int | None = None
        self._pending: list[tuple[Takeaway, int]] = []  # takeaways whose lead is in, details not yet; first claim

    def _emit(self, text: str, claim: Claim | None = None) -> int:
        if claim is not None:
            claim.start, claim.text = self._length, text
            self._claims.append(claim)
        self._parts.append(text)
        self._length += len(text)
        return len(self._claims) - 1

    def say(self, text: str) -> TakeawayBuilder:
        self._emit(text)
        return self

    @property
    def lead_ended(self) -> bool:
        return self._lead_end is not None

    def end_lead(self) -> TakeawayBuilder:
        """The lead ends here: what was said so far (one or two plain sentences saying what held, or that
        nothing did) is the lead; what follows, the details (docs/pages.md, "A takeaway first"). Once only."""
        if self._lead_end is not None:
            raise ValueError("a takeaway's lead ends once")
        self._lead_end = self._length
        return self

    def quote(self, row: Any, column: str, *, fmt: str = ".2f", name: bool | str = True, interval: bool = True,
              q: bool = True, key: str | tuple[str, ...] | None = None, source: str | None = None,
              after: str = "") -> int:
        """A cell: '<name> <value> [<low>, <high>] (q ...)<after>'; `row` a table row (Series or dict) or a
        JSON summary (key=()). name=False leaves the row's name out; a string is said instead of it."""
        key = self.key if key is None else key
        keys = (key,) if isinstance(key, str) else tuple(key)
        value = _num(row[column])
        low = _num(row.get(f"{column}_ci_low")) if interval else None
        high = _num(row.get(f"{column}_ci_high")) if interval else None
        qv = _num(row.get(f"{column}_q")) if q else None
        text = fmt_number(value, fmt) if value is not None else "n/a"
        if low is not None and high is not None:
            text += f" [{fmt_number(low, fmt)}, {fmt_number(high, fmt)}]"
        if qv is not None:
            text += f" ({q_text(qv)})"
        label = str(row[keys[-1]]) if name is True and keys else (name or "")
        if label:
            text = f"{label} {text}"
        text += after
        ids = {k: row[k] if isinstance(row[k], str) else _plain(row[k]) for k in keys} if keys else None
        return self._emit(text, Claim("quote", text, source=source or self.source, row=ids, column=column,
                                      value=value, low=low, high=high, q=qv, fmt=fmt))

    def count(self, k: int, total: int, column: str, condition: str = "true", *, unit: str = "",
              source: str | None = None) -> int:
        """'<k> of <total> <unit>': the rows of `column` meeting `condition` ('true' for a boolean column,
        '<=X' or '>X' for a number; '&COLUMN=VALUE' after it: among those rows only, the total their number)."""
        text = f"{k:,} of {total:,}" + (f" {unit}" if unit else "")
        return self._emit(text, Claim("count", text, source=source or self.source, column=column, value=int(k),
                                      total=int(total), condition=condition, fmt="d"))

    def constant(self, value: Any, column: str, *, fmt: str = "d", unit: str = "", source: str | None = None) -> int:
        """A column equal on every row (n_prompts, ci_level), said as '<value> <unit>'."""
        v = float(value)
        text = (format(int(v), ",") if fmt == "d" else fmt_number(v, fmt)) + (f" {unit}" if unit else "")
        return self._emit(text, Claim("constant", text, source=source or self.source, column=column, value=v, fmt=fmt))

    def setting(self, value: Any, path: str, *, fmt: str = "d", unit: str = "", source: str = "manifest.json") -> int:
        """A setting of the run (a dotted path in its manifest.json's config: stats.fdr)."""
        v = float(value)
        text = (format(int(v), ",") if fmt == "d" else fmt_number(v, fmt)) + (f" {unit}" if unit else "")
        return self._emit(text, Claim("setting", text, source=source, column=path, value=v, fmt=fmt))

    def qualify(self, word: str, rule: str, refs: list[int] | None = None, holds: bool = True,
                condition: str | None = None) -> int:
        """A qualifier: `word` is said, and `rule` (docs/pages.md) holds on the claims at `refs` (which may
        be given later, with `refer`, for a word said before the numbers it judges). condition: the rows a
        ranking rule looks at, a boolean column (in_circuit) or column=value (kind=induction)."""
        return self._emit(word, Claim("qualifier", word, word=word, rule=rule, holds=bool(holds), refs=list(refs or []),
                                      condition=condition))

    def refer(self, qualifier: int, refs: list[int]) -> None:
        self._claims[qualifier].refs = list(refs)

    def value(self, claim: int) -> float | None:
        """The number a claim said (a quote's cell, a count's k)."""
        return self._claims[claim].value

    def no_discovery(self, t: Any, stem: str, fdr: float, *, unit: str = "cells") -> None:
        """The lead of a screen with no discovery: says so at `fdr` (the lead ends there); where the table's
        prompts could not have given any cell a discovery on its own (`prompts_for_discovery`), says that and
        how many prompts could; counts the rows whose interval excludes 0 as candidates, and what would settle
        them."""
        m, n = len(t), int(t["n_prompts"].iloc[0])
        none = self.qualify(f"No {unit[:-1] if unit.endswith('s') else unit} survives the false discovery screen",
                            "none_significant")
        self.say(" at a ")
        self.setting(fdr, "stats.fdr", fmt=".0%")
        self.say(" rate (")
        self.refer(none, [self.count(0, m, "significant", unit=unit)])
        self.say(", Benjamini-Hochberg). ")
        if self._lead_end is None:
            self.end_lead()
        need = prompts_for_discovery(m, fdr)
        if n < need:
            self.say("Over ")
            self.constant(n, "n_prompts", unit="prompts")
            self.say(" none could: among this many, one needs ")
            self._emit(f"{need} prompts", Claim("limit", "", source="manifest.json", column="stats.fdr",
                                                          value=need, total=m, fmt="d"))
            self.say(" or more to be a discovery on its own (the sign-flip test's smallest p). ")
        shown = int(excludes_zero_rows(t, stem).sum())
        self.count(shown, m, stem, "excludes_zero", unit=unit)
        self.say(" have intervals that exclude zero: candidates, not findings; confirm them on fresh prompts "
                 "(confirm) or with more prompts. ")

    def mark(self, row: Any, column: str, *, key: str | tuple[str, ...] | None = None,
             source: str | None = None) -> int:
        """A row named for a flag it has (`column` true: a fragile cell, an edge in the circuit)."""
        key = self.key if key is None else key
        keys = (key,) if isinstance(key, str) else tuple(key)
        text = str(row[keys[-1]])
        ids = {k: row[k] if isinstance(row[k], str) else _plain(row[k]) for k in keys}
        return self._emit(text, Claim("flag", text, source=source or self.source, row=ids, column=column,
                                      condition="true"))

    def ranking(self, table: Any, column: str, k: int, *, fmt: str = ".2f", by_abs: bool = True, sep: str = "; ",
                **quote: Any) -> list[int]:
        """The k rows of largest |column| (or largest column), quoted one after the other."""
        order = (table[column].abs() if by_abs else table[column]).sort_values(ascending=False, kind="stable").index
        refs = []
        for i, idx in enumerate(order[:k]):
            if i:
                self.say(sep)
            refs.append(self.quote(table.loc[idx], column, fmt=fmt, **quote))
        return refs

    def separation(self, first: int, second: int, *, above: str, overlap: str) -> bool:
        """Says `above` ("stands out": the first quote's |interval| lies above the second's, rule
        `separated`) or `overlap` (rule `overlaps`); returns which."""
        a, b = self._claims[first], self._claims[second]
        apart = separated((a.low, a.high), (b.low, b.high))  # type: ignore[arg-type]
        self.qualify(above if apart else overlap, "separated" if apart else "overlaps", [first, second])
        return apart

    def first_two_apart(self, refs: list[int]) -> None:
        """" The first stands out (...)." or " The first two intervals overlap (...).": `separation` of the first
        two quotes of a ranking, as a sentence of its own; nothing with fewer than two."""
        if len(refs) < 2:
            return
        self.say(" ")
        self.separation(refs[0], refs[1], above="The first stands out (its interval lies further from 0 than the "
                        "second's)", overlap="The first two intervals overlap, so the data do not order them")
        self.say(".")

    def against_baseline(self, row: Any, effect: int, *, minus: str, beats: str, what: str, other: str,
                         baseline: str) -> None:
        """" (<what> minus <other> <row[minus]>): the <what> beats / does not beat its random <baseline> there."
        (rules `beats_random` / `not_beats_random`, backed by the effect's quote and the difference's)."""
        self.say(f" ({what} minus {other} ")
        difference = self.quote(row, minus, name=False, fmt="+.3g")
        ok = bool(row[beats])
        self.say(f"): the {what} ")
        self.qualify("beats" if ok else "does not beat", "beats_random" if ok else "not_beats_random",
                     [effect, difference])
        self.say(f" its random {baseline} there.")

    def include(self, other: str, prefix: str | None = None, part: str = "all") -> TakeawayBuilder:
        """Another takeaway's text and claims (its sources under `prefix`, the folder it was saved in).

        part: "all" (its whole text; its own lead mark is not kept), "lead" (its lead: its claims all come in
        now, those of its details placed when they follow) or "details" (its details, after its lead)."""
        whole = str(other)
        end = getattr(other, "lead_end", None)
        end = len(whole) if end is None else end
        text = whole if part == "all" else split_lead(other)[0 if part == "lead" else 1]
        if isinstance(other, Takeaway) and part == "details":
            at = next((i for i, (t, _) in enumerate(self._pending) if t is other), None)
            if at is None:
                raise ValueError("a takeaway's details are included after its lead")
            base = self._pending.pop(at)[1]
            skip = end + _leading_space(whole[end:])
            for i, c in enumerate(other.claims):
                if c.start >= end:
                    self._claims[base + i].start = c.start - skip + self._length
        elif isinstance(other, Takeaway):
            base = len(self._claims)
            skip = _leading_space(whole) if part == "lead" else 0
            moved = other.rebased(prefix) if prefix else other
            for c in moved.claims:
                inside = part == "all" or c.start < end
                self._claims.append(replace(c, start=c.start - skip + self._length if inside else -1,
                                            refs=[r + base for r in c.refs]))
            if part == "lead":
                self._pending.append((other, base))
        self._parts.append(text)
        self._length += len(text)
        return self

    def build(self) -> Takeaway:
        if self._pending:
            raise ValueError("a takeaway's lead was included without its details")
        return Takeaway("".join(self._parts), self._claims, self._lead_end)


def join(takeaways: list[str], sep: str = " ", labels: list[str] | None = None,
         prefixes: list[str | None] | None = None) -> Takeaway:
    """Takeaways one after the other, claims kept: their leads first (each after its label, where given),
    which make the joined lead, then their details in the same order (each after its label again)."""
    items = [(labels[i] if labels else "", t, prefixes[i] if prefixes else None) for i, t in enumerate(takeaways)]
    items = [x for x in items if x[1]]
    b = TakeawayBuilder()
    for i, (label, t, prefix) in enumerate(items):
        b.say((sep if i else "") + label)
        b.include(t, prefix, part="lead")
    b.end_lead()
    for label, t, prefix in items:
        if split_lead(t)[1]:
            b.say(sep + label)
        b.include(t, prefix, part="details")
    return b.build()
