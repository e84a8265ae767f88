"""Every sentence and every mark on the demo report's pages is true of its numbers.

One quick demo report is built; then, reading only the files it wrote:
- every takeaway (each run's takeaway.json, the sections' takeaways.json, the feature pages') is checked
  claim by claim against the saved tables: each quoted value, interval and q is the table's cell, each
  count is the number of rows the table has with that flag, each constant is on every row, each setting
  is the run's manifest; every digit of the text lies inside a claim, and no qualifier word ("most",
  "strongest", "largest", ...) is said outside one;
- every qualifier is checked against its rule, re-implemented here from docs/pages.md's thresholds;
- every lead and takeaway paragraph on every page is one of the recorded takeaways (or states no number);
- every plotly figure of every page is read from its HTML, and every error bar, band and interval in a
  hover text is compared with the interval columns of the table it draws.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

MOST = 0.5  # docs/pages.md: "most" = value >= 0.5 and the interval's lower end > 0.5
QUALIFIER_WORDS = re.compile(r"\b(most|strongest|strongly|largest|highest|carr(?:y|ies)|restores?|significant(?:ly)?|"
                             r"stands? out|above 0|below 0|includes 0|exceeds?|no single|survives?|as much)\b", re.I)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import entoscope as es
    from entoscope.report import build_report

    folder = tmp_path_factory.mktemp("claims") / "demo"
    build_report(es.load_model("demo"), folder, quick=True)
    return folder


def _recorded(root: Path) -> list[tuple[Path, Path, dict]]:
    """(folder the sources are relative to, the page, the takeaway) for every recorded takeaway."""
    out = []
    for path in sorted(root.rglob("takeaway*.json")):
        for entry in json.loads(path.read_text()):
            out.append((path.parent, path.parent / entry["page"], entry))
    return out


class Tables:
    def __init__(self) -> None:
        self.cache: dict[Path, object] = {}

    def __call__(self, path: Path):
        if path not in self.cache:
            if path.suffix == ".json":
                self.cache[path] = json.loads(path.read_text())
            else:
                self.cache[path] = pd.read_csv(path, keep_default_na=True)
        return self.cache[path]

    def row(self, base: Path, claim: dict):
        data = self(base / claim["source"])
        if not claim["row"]:
            assert isinstance(data, dict), claim
            return data
        hit = np.ones(len(data), dtype=bool)
        for k, v in claim["row"].items():
            hit &= data[k].astype(str).to_numpy() == str(v)
        assert hit.sum() == 1, f"{claim['source']}: {claim['row']} selects {hit.sum()} rows"
        return data[hit].iloc[0]


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _fmt(v: float, fmt: str) -> str:
    return format(int(round(v)), fmt) if fmt.endswith("d") else format(v, fmt)


def _close(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9,
                                                                                         abs_tol=1e-12))


def _path(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def test_every_number_of_every_takeaway_is_its_table_cell(report):
    tables = Tables()
    entries = _recorded(report)
    assert len(entries) >= 20
    n_claims = 0
    for base, page, entry in entries:
        text = entry["text"]
        covered = np.zeros(len(text), dtype=bool)
        for c in entry["claims"]:
            where = f"{page.relative_to(report)}: {c['text']!r}"
            assert text[c["start"]:c["start"] + len(c["text"])] == c["text"], where
            covered[c["start"]:c["start"] + len(c["text"])] = True
            if c["type"] == "quote":
                row = tables.row(base, c)
                value = _num(row[c["column"]])
                assert _close(value, c["value"]), where
                assert _fmt(value, c["fmt"]) in c["text"], where
                for end in ("low", "high"):
                    if c[end] is not None:
                        cell = _num(row[f"{c['column']}_ci_{end}"])
                        assert _close(cell, c[end]) and _fmt(cell, c["fmt"]) in c["text"], where
                    elif f"{c['column']}_ci_{end}" in row:  # a named row carries its interval where it has one
                        assert _num(row[f"{c['column']}_ci_{end}"]) is None or c["column"] == "n_held_out", where
                if f"{c['column']}_q" in row and _num(row[f"{c['column']}_q"]) is not None:
                    q = _num(row[f"{c['column']}_q"])
                    assert _close(q, c["q"]), f"{where}: its q is not said"
                    assert ("q < 0.001" if q < 0.001 else f"q = {q:.2g}") in c["text"], where
            elif c["type"] == "count":
                frame = tables(base / c["source"])
                col = frame[c["column"]]
                hits = col.astype(str).str.lower().eq("true").sum() if c["condition"] == "true" else None
                assert hits == c["value"] and len(frame) == c["total"], where
                assert f"{c['value']:,} of {c['total']:,}" in c["text"], where
            elif c["type"] == "constant":
                frame = tables(base / c["source"])
                values = frame[c["column"]].to_numpy(dtype=float)
                assert np.allclose(values, c["value"]), where
                assert _fmt(c["value"], c["fmt"]) in c["text"], where
            elif c["type"] == "setting":
                manifest = tables(base / c["source"])
                assert _close(float(_path(manifest["config"], c["column"])), c["value"]), where
                assert _fmt(c["value"], c["fmt"]) in c["text"], where
            elif c["type"] == "flag":
                row = tables.row(base, c)
                assert str(row[c["column"]]).lower() == "true", where
            n_claims += 1
        loose = "".join(ch if not covered[i] else " " for i, ch in enumerate(text))
        digits = re.findall(r"\S*\d\S*", loose)
        assert not digits, f"{page.relative_to(report)}: numbers outside any claim: {digits} in {text!r}"
        words = QUALIFIER_WORDS.findall(loose)
        assert not words, f"{page.relative_to(report)}: qualifiers outside any rule: {words} in {text!r}"
    assert n_claims > 200


# ------------------------------------------------------------------ the rules, from docs/pages.md

def _most(c) -> bool:
    if c["low"] is None:
        return c["value"] > MOST
    return c["value"] >= MOST and c["low"] > MOST


def _magnitude(c) -> tuple[float, float]:
    lo, hi = c["low"], c["high"]
    return (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))


def _separated(a, b) -> bool:
    if None in (a["low"], a["high"], b["low"], b["high"]):
        return False
    return _magnitude(a)[0] > _magnitude(b)[1]


def _top(tables, base, refs, by_abs: bool, condition) -> bool:
    """Each source's quoted rows are its rows of largest (|)value(|), as many as are quoted."""
    by_source: dict[str, list] = {}
    for c in refs:
        by_source.setdefault(c["source"], []).append(c)
    for source, quotes in by_source.items():
        frame = tables(base / source)
        if condition and "=" in condition:
            column, value = condition.split("=", 1)
            frame = frame[frame[column].astype(str) == value]
        elif condition:
            frame = frame[frame[condition].astype(str).str.lower() == "true"]
        col = frame[quotes[0]["column"]].astype(float)
        best = sorted((col.abs() if by_abs else col).to_numpy(), reverse=True)[:len(quotes)]
        said = [abs(q["value"]) if by_abs else q["value"] for q in quotes]
        if not np.allclose(said, best):
            return False
    return True


def test_every_qualifier_follows_its_rule(report):
    tables = Tables()
    seen: dict[str, int] = {}
    for base, page, entry in _recorded(report):
        claims = entry["claims"]
        for c in claims:
            if c["type"] != "qualifier":
                continue
            refs = [claims[i] for i in c["refs"]]
            rule = c["rule"]
            seen[rule] = seen.get(rule, 0) + 1
            where = f"{page.relative_to(report)}: {c['word']!r} ({rule})"
            assert c["holds"] and (refs or rule in ("most",)), where
            if rule == "most":
                ok = all(_most(r) for r in refs)
            elif rule == "not_most":
                ok = not any(_most(r) for r in refs)
            elif rule == "none_most":
                frame = tables(base / refs[0]["source"])
                col = refs[0]["column"]
                ok = not ((frame[col] >= MOST) & (frame[f"{col}_ci_low"] > MOST)).any()
            elif rule in ("top_by_abs", "top_by_value"):
                ok = _top(tables, base, refs, rule == "top_by_abs", c["condition"])
            elif rule == "separated":
                ok = _separated(refs[0], refs[1]) and abs(refs[0]["value"]) >= abs(refs[1]["value"])
            elif rule == "overlaps":
                ok = not _separated(refs[0], refs[1])
            elif rule == "above":  # the first's interval lies above the second's, the runner-up
                frame = tables(base / refs[0]["source"])
                second = sorted(frame[refs[0]["column"]].astype(float), reverse=True)[1]
                ok = refs[0]["low"] > refs[1]["high"] and math.isclose(refs[1]["value"], second)
            elif rule == "not_above":
                ok = not refs[0]["low"] > refs[1]["high"]
            elif rule == "above_zero":
                ok = refs[0]["low"] > 0
            elif rule == "below_zero":
                ok = refs[0]["high"] < 0
            elif rule == "includes_zero":
                ok = refs[0]["low"] <= 0 <= refs[0]["high"]
            elif rule == "random_as_large":
                ok = abs(refs[1]["value"]) >= abs(refs[0]["value"])
            elif rule == "distinguished":
                ok = abs(refs[0]["value"]) > abs(refs[1]["value"]) and (refs[2]["low"] > 0 or refs[2]["high"] < 0)
            elif rule == "none_significant":
                ok = all(r["type"] == "count" and r["value"] == 0 for r in refs)
            elif rule == "above_all":
                frame = tables(base / refs[1]["source"])
                numeric = frame[frame["example"].astype(str).str.isdigit()]
                ok = refs[0]["value"] > refs[1]["value"] and math.isclose(refs[1]["value"],
                                                                        numeric[refs[1]["column"]].max())
            else:
                raise AssertionError(f"{where}: a rule docs/pages.md does not define")
            assert ok, where
    for rule in ("most", "not_most", "top_by_abs", "overlaps", "none_significant", "random_as_large",
                 "includes_zero", "above_zero"):
        assert seen.get(rule), f"the demo report exercises no {rule!r} qualifier"


def test_every_lead_on_every_page_is_a_recorded_takeaway(report):
    recorded = {}
    for _, page, entry in _recorded(report):
        recorded.setdefault(page.resolve(), set()).add(entry["text"])
    every = set().union(*recorded.values())
    for page in sorted(report.rglob("*.html")):
        text = page.read_text()
        for m in re.finditer(r'<p class="(lead|takeaway)">(.*?)</p>', text, re.S):
            said = html.unescape(m.group(2))
            if said in every:
                continue
            assert not re.search(r"\d", said), f"{page.relative_to(report)}: an unrecorded lead states numbers: {said!r}"
