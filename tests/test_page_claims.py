"""Every sentence and every mark on the demo report's pages is true of its numbers.

One quick demo report is built; then, reading only the files it wrote:
- every takeaway (each run's takeaway.json, the sections' takeaways.json, the feature pages') is checked
  claim by claim against the saved tables: each quoted value, interval and q is the table's cell, each
  count is the number of rows the table has with that flag, each constant is on every row, each setting
  is the run's manifest; every digit of the text lies inside a claim, and no qualifier word ("most",
  "strongest", "largest", ...) is said outside one;
- every qualifier is checked against its rule, re-implemented here from docs/pages.md's thresholds;
- every lead and takeaway paragraph on every page is one of the recorded takeaways' leads or details (or states no
  number); each page shows a takeaway's lead in its lead box and its details just below, which together are the
  recorded takeaway; each section's line at a glance is its lead only, at most two sentences;
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
CONTROL_MARGIN = 0.1  # docs/pages.md: a head passes its shuffled control when score - control's lower end > 0.1
QUALIFIER_WORDS = re.compile(r"\b(most|strongest|strongly|largest|highest|carr(?:y|ies)|restores?|significant(?:ly)?|"
                             r"stands? out|above 0|below 0|includes 0|exceeds?|no single|survives?|as much|material|"
                             r"negligible|(?:un)?settled)\b", re.I)
NEGLIGIBLE = 0.05  # docs/pages.md: an effect within 5% of |the unsteered metric| is negligible
SETTLED = 0.1  # docs/lens.md: a Jacobian lens's layer is settled when its split-half change is under 0.1


@pytest.fixture(scope="module", params=["demo", "demo_large", pytest.param("smollm2", marks=pytest.mark.real),
                                        pytest.param("gemma3", marks=pytest.mark.real)])
def report(request, tmp_path_factory):
    """The demo's quick report, and the real models' (conftest.real_report: the sections that cost seconds);
    demo_large: the demo's circuits, head-score, IFR, patching, steering, probing and lens sections sized as a
    large model's (report/sizes.py: EAP at a 5% budget, no circuit found, so the lead's words for that are read
    against the tables too; attribution maps with their exact re-check)."""
    import entoscope as es
    from entoscope.report import build_report

    if request.param == "demo_large":
        from entoscope.report import sizes

        folder = tmp_path_factory.mktemp("claims") / "demo_large"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sizes, "SMALL_MACS", 0.0)
            build_report(es.load_model("demo"), folder, quick=True, quiet=True,
                         sections=["circuits", "head_scores", "ifr", "lens", "patching", "probing", "steering"])
        assert (folder / "patching" / "example1" / "recheck.csv").exists()
        return folder

    if request.param != "demo":
        from conftest import real_report

        folder = real_report(request.param, tmp_path_factory)
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["model"]["structure"]["quantization"].startswith("GGUF ")
        assert "dequantized from GGUF" in (folder / "index.html").read_text()
        assert not manifest.get("not_run"), manifest.get("not_run")
        return folder
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
    assert len(entries) >= (20 if report.name == "demo" else 4)  # the real reports: 3-4 sections
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
                col = frame.get(c["column"])
                condition, _, among = c["condition"].partition("&")  # "true&kind=induction": among those rows
                if among:
                    column, value = among.split("=", 1)
                    frame = frame[frame[column].astype(str) == value]
                    col = frame[c["column"]]
                if condition == "excludes_zero":  # rows whose interval of the column excludes 0
                    hits = int(((frame[f"{c['column']}_ci_low"] > 0) | (frame[f"{c['column']}_ci_high"] < 0)).sum())
                elif condition == "true":
                    hits = col.astype(str).str.lower().eq("true").sum()
                else:  # a comparison with a number: ">=1", "<0.5"
                    hits = int(_compare(col.astype(float), condition).sum())
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
            elif c["type"] == "limit":  # the fewest n with 2^-(n-1) <= fdr / cells: the sign-flip test's limit
                fdr = float(_path(tables(base / c["source"])["config"], c["column"]))
                n = c["value"]
                assert 2.0 ** -(n - 1) <= fdr / c["total"] < 2.0 ** -(n - 2), where
                assert f"{n} prompts" in c["text"], where
            elif c["type"] == "flag":
                row = tables.row(base, c)
                assert str(row[c["column"]]).lower() == "true", where
            n_claims += 1
        loose = "".join(ch if not covered[i] else " " for i, ch in enumerate(text))
        digits = re.findall(r"\S*\d\S*", loose)
        assert not digits, f"{page.relative_to(report)}: numbers outside any claim: {digits} in {text!r}"
        words = QUALIFIER_WORDS.findall(loose)
        assert not words, f"{page.relative_to(report)}: qualifiers outside any rule: {words} in {text!r}"
    assert n_claims > (200 if report.name == "demo" else 30)  # the real reports: three sections


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


def _compare(values, condition: str):
    """The rows of `values` meeting a comparison written as ">=1", "<=0.5", ">0", "<2"."""
    m = re.fullmatch(r"(>=|<=|>|<)(.+)", condition)
    assert m, condition
    op, x = m.group(1), float(m.group(2))
    return {">=": values >= x, "<=": values <= x, ">": values > x, "<": values < x}[op]


def _top(tables, base, refs, by_abs: bool, condition) -> bool:
    """Each source's quoted rows are its rows of largest (|)value(|), as many as are quoted."""
    by_source: dict[str, list] = {}
    for c in refs:
        by_source.setdefault(c["source"], []).append(c)
    for source, quotes in by_source.items():
        frame = tables(base / source)
        compared = re.fullmatch(r"(\w+)(>=|<=|>|<)(.+)", condition or "")
        if compared:
            frame = frame[_compare(frame[compared.group(1)].astype(float), condition[len(compared.group(1)):])]
        elif condition and "=" in condition:
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
            elif rule == "clears":  # a head over its shuffled control: the interval's lower end above a tenth
                ok = all(r["low"] is not None and r["low"] > CONTROL_MARGIN for r in refs)
            elif rule == "none_clears":  # no row of the kind clears it (the quoted highest is only an example)
                frame = tables(base / refs[0]["source"])
                column, value = c["condition"].split("=", 1)
                rows = frame[frame[column].astype(str) == value]
                ok = not (rows["over_control_ci_low"] > CONTROL_MARGIN).any()
            elif rule == "reaches_target":  # the circuit's faithfulness (point estimate) reaches the target
                ok = refs[0]["column"] == "faithfulness" and refs[0]["value"] >= refs[1]["value"]
            elif rule == "first_reaches":  # the curve's first point (fewest edges) at or above the target
                n, target = refs
                curve = tables(base / n["source"]).sort_values("n_edges")
                first = curve[curve["faithfulness"] >= target["value"]].iloc[0]
                ok = int(first["n_edges"]) == int(n["value"])
            elif rule == "none_reaches":  # the best point read of at most the budget is below the target
                f, target, budget = refs
                curve = pd.concat([tables(base / f["source"].replace("summary.json", name))
                                   for name in ("faithfulness.csv", "search.csv")
                                   if (base / f["source"].replace("summary.json", name)).exists()])
                within = curve[(curve["n_edges"] >= 1) & (curve["n_edges"] <= budget["value"])]
                ok = f["value"] < target["value"] and math.isclose(f["value"], within["faithfulness"].max())
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
            elif rule in ("smallest_effective", "none_effective"):
                frame = tables(base / refs[0]["source"])
                steered = frame[frame["direction"] == "direction"]
                shown = steered[(steered["effect_ci_low"] > 0) | (steered["effect_ci_high"] < 0)]
                if rule == "none_effective":
                    ok = not len(shown)
                else:
                    first = shown.iloc[int(np.argmin(np.abs(shown["coefficient"].to_numpy(float))))]
                    ok = str(first["condition"]) == refs[0]["row"]["condition"]
            elif rule in ("smallest_material", "none_material", "negligible"):
                frame = tables(base / refs[0]["source"])
                steered = frame[frame["direction"] == "direction"]
                band = NEGLIGIBLE * steered["metric_unsteered"].abs()
                low, high = steered["effect_ci_low"], steered["effect_ci_high"]
                material = steered[(low > band) | (high < -band)]
                if rule == "none_material":
                    ok = not len(material)
                elif rule == "negligible":
                    ok = bool(((low > -band) & (high < band)).all())
                else:
                    first = material.iloc[int(np.argmin(np.abs(material["coefficient"].to_numpy(float))))]
                    ok = str(first["condition"]) == refs[0]["row"]["condition"]
            elif rule == "leads_layers":  # from the first quoted cell's layer to the last's, the position leads
                frame = tables(base / refs[0]["source"])
                position = c["condition"].split("=", 1)[1]
                ends = [tables.row(base, r) for r in refs]
                lo, hi = int(ends[0]["layer"]), int(ends[-1]["layer"])
                ok = all(str(e["position"]) == position for e in ends)
                for layer, rows in frame[(frame["layer"] >= lo) & (frame["layer"] <= hi)].groupby("layer"):
                    best = rows.loc[rows["value"].astype(float).idxmax()]
                    ok &= str(best["position"]) == position and float(best["value_ci_low"]) > 0
            elif rule in ("settled", "unsettled"):  # the largest split-half change of the lens's layers
                frame = tables(base / refs[0]["source"])
                worst = frame["split_half_change"].max()
                ok = math.isclose(refs[0]["value"], worst) and (worst < SETTLED) == (rule == "settled")
            elif rule in ("beats_random", "not_beats_random"):
                effect, minus = refs
                shown = effect["low"] > 0 or effect["high"] < 0
                same_side = minus["low"] > 0 if effect["value"] > 0 else minus["high"] < 0
                ok = (shown and same_side) == (rule == "beats_random")
            else:
                raise AssertionError(f"{where}: a rule docs/pages.md does not define")
            assert ok, where
    if report.name != "demo":  # the real reports' few sections need not use every rule
        assert sum(seen.values()) >= 4, seen
        return
    for rule in ("most", "clears", "none_clears", "reaches_target", "top_by_abs", "overlaps", "none_significant",
                 "random_as_large", "includes_zero", "above_zero"):
        assert seen.get(rule), f"the demo report exercises no {rule!r} qualifier"


def _parts(entry: dict) -> tuple[str, str]:
    """(lead, details) of a recorded takeaway, cut at its recorded lead_end (None: all lead)."""
    text, end = entry["text"], entry.get("lead_end")
    return (text.strip(), "") if end is None else (text[:end].strip(), text[end:].strip())


def sentences(text: str) -> list[str]:
    """The sentences of a text: a '.', '!' or '?' ends one where whitespace (or the end) follows it and it is
    outside any bracket; a decimal point (a digit follows it) and '(...).' inside brackets end none."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif ch in ".!?" and depth == 0 and (i + 1 == len(text) or text[i + 1].isspace()):
            out.append(text[start:i + 1].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def test_the_sentence_counter_ignores_decimal_points_and_brackets():
    assert len(sentences("a2.h0 0.40 [0.29, 0.54] (q = 0.0015; e.g. x). Next one 1.5.")) == 2
    assert len(sentences("One (two. three.) four.")) == 1 and len(sentences("No end")) == 1


def test_every_lead_at_a_glance_is_at_most_two_sentences_and_the_sections_lead(report):
    """docs/pages.md "At a glance": each section's line on the index is its lead only (one or two sentences),
    and every run page and section shows the lead in the lead box and the details just below, which together
    are the recorded takeaway."""
    index = (report / "index.html").read_text()
    glance = re.search(r'<h2 id="at-a-glance">.*?<ul class="glance">(.*?)</ul>', index, re.S).group(1)
    items = [html.unescape(re.sub(r"<[^>]+>", "", li)) for li in re.findall(r"<li>(.*?)</li>", glance, re.S)]
    sections = [e for e in json.loads((report / "takeaways.json").read_text())]
    shown = [item for item in items if ": not run (" not in item]
    assert len(shown) == len(sections) >= (3 if report.name != "demo" else 9)  # the real reports: 3 sections
    for item, entry in zip(shown, sections):
        lead, details = _parts(entry)
        assert item.endswith(": " + lead), (item, lead)  # the section's title, then its lead only
        assert len(sentences(lead)) <= 2, f"a lead of {len(sentences(lead))} sentences at a glance: {lead!r}"
        if len(sentences(entry["text"])) > 2:
            assert details, f"a takeaway of {len(sentences(entry['text']))} sentences has no lead mark: {lead!r}"
        said = re.search(r'<p class="takeaway">' + re.escape(html.escape(lead)) + r'</p>(<p class="details">(.*?)</p>)?',
                         index)
        assert said, f"the section's lead box is not its lead: {lead!r}"
        assert html.unescape(said.group(2) or "") == details  # the details just below the lead box


def test_every_run_page_shows_its_lead_then_its_details_which_are_the_recorded_takeaway(report):
    n = 0
    for _, page, entry in _recorded(report):
        if page.parent == report:
            continue  # the index: the test above
        lead, details = _parts(entry)
        text = page.read_text()
        m = re.search(r'<p class="lead">(.*?)</p>(<p class="details">(.*?)</p>)?', text, re.S)
        assert m, f"{page.relative_to(report)}: no lead box"
        shown_lead, shown_details = html.unescape(m.group(1)), html.unescape(m.group(3) or "")
        assert (shown_lead, shown_details) == (lead, details), page.relative_to(report)
        whole = " ".join(f"{shown_lead} {shown_details}".split())
        assert whole == " ".join(entry["text"].split()), page.relative_to(report)  # nothing lost, nothing added
        n += 1
    assert n >= (20 if report.name == "demo" else 3)


def test_every_lead_on_every_page_is_a_recorded_takeaway(report):
    recorded = {}
    for _, page, entry in _recorded(report):
        recorded.setdefault(page.resolve(), set()).update({entry["text"], *_parts(entry)})
    every = set().union(*recorded.values())
    name = json.loads((report / "manifest.json").read_text())["model"]["name"]  # a model's name may hold digits
    for page in sorted(report.rglob("*.html")):
        text = page.read_text()
        for m in re.finditer(r'<p class="(lead|takeaway|details)">(.*?)</p>', text, re.S):
            said = html.unescape(m.group(2))
            if said in every:
                continue
            assert not re.search(r"\d", said.replace(name, "")), f"{page.relative_to(report)}: an unrecorded lead states numbers: {said!r}"


# ------------------------------------------------------------------ figures: every mark is the table's interval

HOVER_LINE = re.compile(r"(?P<col>[A-Za-z_]+) (?P<v>\S+) \((?P<lvl>\d+)% CI \[(?P<lo>[^,\]]+), (?P<hi>[^\]]+)\]\)")
ID_COLUMNS = ("site", "component", "edge", "node")


def _decode(v):
    """A plotly JSON array: a list, or {dtype, bdata (base64), shape}."""
    import base64

    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        return a.reshape([int(x) for x in str(v["shape"]).split(",")]) if "shape" in v else a
    return np.asarray(v, dtype=object)


def _plotly_figures(page: Path):
    text = page.read_text()
    decoder = json.JSONDecoder()
    for m in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', text):
        data, end = decoder.raw_decode(text, m.end())
        rest = text[end:].lstrip()
        assert rest.startswith(",")
        layout, _ = decoder.raw_decode(rest[1:].lstrip())
        yield data, layout


def _words(layout: dict, data: list) -> str:
    """Every title, legend entry and colour bar title of a figure."""
    out = []

    def title(x):
        return (x.get("text") or "") if isinstance(x, dict) else (x or "")
    out.append(title(layout.get("title")))
    out += [title(v.get("title")) for k, v in layout.items() if k.startswith(("xaxis", "yaxis")) and isinstance(v, dict)]
    out += [a.get("text", "") for a in layout.get("annotations", [])]
    out += [t.get("name") or "" for t in data]
    out += [title((t.get("colorbar") or {}).get("title")) for t in data]
    return " ".join(out)


def _strings(v) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple, np.ndarray)):
        return [s for x in v for s in _strings(x)]
    return []


def _fmt3(x) -> str:
    return f"{float(x):.3g}"


def _folders(report: Path, page: Path) -> list[Path]:
    """Where a page's tables are: its own folder; the report's summary page embeds every section's."""
    if page.parent == report:
        return sorted({p.parent for p in report.rglob("table.csv")})
    return [page.parent]


def test_every_error_bar_band_and_hover_interval_is_the_tables(report):
    tables = Tables()
    counts = {"bars": 0, "bands": 0, "hovers": 0, "figures": 0}
    for page in sorted(report.rglob("*.html")):
        folders = _folders(report, page)
        csvs = [p for f in folders for p in sorted(f.glob("*.csv")) + sorted(f.glob("summary.json"))]
        for data, layout in _plotly_figures(page):
            counts["figures"] += 1
            words = _words(layout, data)
            where = f"{page.relative_to(report)}: {(layout.get('title') or {}).get('text', '')!r}"
            for trace in data:
                meta = trace.get("meta") or {}
                for axis in ("x", "y"):
                    err = trace.get(f"error_{axis}")
                    if not err or err.get("visible") is False or "array" not in err:
                        continue
                    col = meta.get(f"interval_of_{axis}") or meta.get("interval_of")
                    assert col, f"{where}: error bars that do not name their table ({trace.get('name')})"
                    values = _decode(trace[axis]).astype(float)
                    plus, minus = _decode(err["array"]).astype(float), _decode(err.get("arrayminus", err["array"])).astype(float)
                    ids = list(trace.get("customdata") or [])
                    matched = False
                    for folder in folders:
                        path = folder / meta["table"]
                        if not path.exists():
                            continue
                        table = tables(path)
                        if (meta.get("key") is not None and meta["key"] not in table) or col not in table:
                            continue
                        ok = True
                        for i, ident in enumerate(ids):
                            row = table if meta.get("key") is None else \
                                table[table[meta["key"]].astype(str) == str(ident)]
                            if isinstance(row, pd.DataFrame):
                                if len(row) != 1:
                                    ok = False
                                    break
                                row = row.iloc[0]
                            ok &= math.isclose(values[i], float(row[col]), rel_tol=1e-6, abs_tol=1e-9)
                            ok &= math.isclose(values[i] - minus[i], float(row[f"{col}_ci_low"]), rel_tol=1e-6, abs_tol=1e-9)
                            ok &= math.isclose(values[i] + plus[i], float(row[f"{col}_ci_high"]), rel_tol=1e-6, abs_tol=1e-9)
                            level = f"{round(100 * float(row['ci_level']))}% interval"
                            ok &= level in words
                        matched |= bool(ok and ids)
                    assert matched, f"{where}: error bars of {col} are not the table's interval (or the level is not named)"
                    counts["bars"] += len(ids)
                if meta.get("band_of"):
                    own = page.parent / meta["table"]
                    # on the summary page: a section's own file (its page may embed several runs' curves: any one)
                    candidates = [tables(own)] if own.exists() else [tables(p) for p in csvs if p.name == meta["table"]]
                    xs, ys = _decode(trace["x"]).astype(float), _decode(trace["y"]).astype(float)
                    col = meta["band_of"]

                    def drawn(curve) -> bool:
                        return len(xs) == 2 * len(curve) and np.allclose(
                            xs, list(curve[meta["x"]]) + list(curve[meta["x"]])[::-1]) and np.allclose(
                            ys, list(curve[f"{col}_ci_high"]) + list(curve[f"{col}_ci_low"])[::-1])
                    curve = next((c for c in candidates if drawn(c)), None)
                    assert curve is not None, f"{where}: a band that is no table's interval"
                    assert f"{round(100 * float(curve['ci_level'].iloc[0]))}% interval" in words, where
                    counts["bands"] += len(curve)
                for key in ("text", "hovertext", "customdata"):
                    for said in _strings(trace.get(key)):
                        for m in HOVER_LINE.finditer(said):
                            first = said.split("<br>")[0]
                            assert _hover_row_exists(tables, csvs, first, m), f"{where}: hover {said!r}"
                            counts["hovers"] += 1
            for trace in data:
                if trace.get("type") == "heatmap" and trace.get("showscale") is not False:
                    t = ((trace.get("colorbar") or {}).get("title") or {}).get("text", "")
                    assert t and ("(" in t or "probability" in t or "share" in t), f"{where}: colour bar title {t!r}"
    if report.name == "demo":  # the real reports have no lens band over layers in every section
        assert counts["bars"] >= 50 and counts["bands"] >= 5 and counts["hovers"] >= 200, counts
    elif report.name == "demo_large":  # three sections: the circuits' curves, the head scores' hovers
        assert counts["bars"] >= 2 and counts["bands"] >= 4 and counts["hovers"] >= 100, counts
    else:
        assert counts["bars"] >= 20 and counts["hovers"] >= 200, counts


def _hover_row_exists(tables: Tables, csvs: list[Path], first: str, m) -> bool:
    """Some table beside the page has a row named in the hover's first line whose column, interval and
    level are the ones the hover prints."""
    col = m.group("col")
    for path in csvs:
        table = tables(path)
        table = pd.DataFrame([table]) if isinstance(table, dict) else table
        if f"{col}_ci_low" not in table:
            continue
        hit = (table[col].map(_fmt3) == m.group("v")) & (table[f"{col}_ci_low"].map(_fmt3) == m.group("lo")) \
            & (table[f"{col}_ci_high"].map(_fmt3) == m.group("hi"))
        hit &= (table["ci_level"] * 100).round().astype(int).astype(str) == m.group("lvl")
        ids = [c for c in ID_COLUMNS if c in table]
        if ids:
            named = np.zeros(len(table), dtype=bool)
            tokens = set(re.split(r"[\s:]+", first))
            for c in ids:
                named |= table[c].astype(str).isin(tokens).to_numpy()
            hit &= named
        if hit.any():
            return True
    return False


# ------------------------------------------------------------------ the circuit drawing: no edge runs over a node

def _edge_paths(data: list) -> list[np.ndarray]:
    paths = []
    for t in data:
        if t.get("mode") != "lines" or t.get("x") is None:
            continue
        xs, ys = _decode(t["x"]), _decode(t["y"])
        cut = [-1] + [i for i, v in enumerate(xs) if v is None] + [len(xs)]
        for a, b in zip(cut[:-1], cut[1:]):
            if b - a > 2:
                paths.append(np.array([[float(xs[i]), float(ys[i])] for i in range(a + 1, b)]))
    return paths


NODE_CLEAR_PX, PORT_CLEAR_PX = 9.0, 4.5  # a 16 px node marker, a 5 px port marker, and a pixel or so to spare


def _markers(data: list) -> tuple[np.ndarray, np.ndarray]:
    """Every node and port marker of a circuit drawing: (x, y) and whether it is a node (not a q/k/v port)."""
    pts, node = [], []
    for t in data:
        if t.get("mode") in ("markers", "markers+text") and (t.get("marker") or {}).get("opacity") != 0 \
                and t.get("x") is not None:
            xy = [(float(x), float(y)) for x, y in zip(_decode(t["x"]), _decode(t["y"])) if x is not None]
            pts += xy
            node += [t.get("mode") == "markers+text"] * len(xy)
    return np.array(pts), np.array(node)


def _gap_px(path: np.ndarray, point: np.ndarray, scale: np.ndarray) -> float:
    P, q = path * scale, point * scale
    a, b = P[:-1], P[1:]
    ab = b - a
    t = np.clip(((q - a) * ab).sum(1) / np.maximum((ab ** 2).sum(1), 1e-12), 0, 1)
    return float(np.sqrt(((q - (a + t[:, None] * ab)) ** 2).sum(1)).min())


def _check_drawing(data: list, layout: dict, where: str) -> int:
    """No edge passes over a node (within 9 px of its centre) or a port (4.5 px) that is not its own: its two
    ends, the receiver's node just above the port it lands on, the sender's ports just below it. The plot
    area is taken as 1000 px wide and the figure's height less its margins tall."""
    markers, is_node = _markers(data)
    height = float(layout["height"]) - 160.0
    scale = np.array([1000.0 / (np.ptp(markers[:, 0]) + 1.0), height / (np.ptp(markers[:, 1]) + 0.6)])
    checked = 0
    for path in _edge_paths(data):
        start, end = path[0], path[-1]
        for m, node in zip(markers, is_node):
            d_start, d_end = (np.hypot(*((m - p) * scale)) for p in (start, end))
            if min(d_start, d_end) < 1.0:
                continue
            if node and abs(m[0] - end[0]) <= 0.25 and 0 < m[1] - end[1] <= 0.25:
                continue  # the receiver, above the port the edge lands on
            if not node and m[1] < start[1] and d_start <= 60.0:
                continue  # the sender's own ports
            need = NODE_CLEAR_PX if node else PORT_CLEAR_PX
            assert _gap_px(path, m, scale) >= need, f"{where}: an edge from {start} to {end} passes over {m}"
        checked += 1
    return checked


def test_no_circuit_edge_runs_over_a_node(report):
    n = 0
    if not (report / "circuits").is_dir():
        pytest.skip("this report has no circuits section (the real reports leave it out: minutes on a CPU)")
    for page in sorted(report.rglob("circuit*.html")) + [report / "circuits" / "index.html"]:
        for data, layout in _plotly_figures(page):
            if "layer" in str((layout.get("yaxis") or {}).get("title")):
                n += _check_drawing(data, layout, str(page.relative_to(report)))
    if report.name == "demo_large":  # no circuit found within the large tier's budget: none is drawn anywhere
        assert n == 0
    else:
        assert n >= 40


@pytest.mark.parametrize("layers,heads,kv,parallel", [(6, 4, None, False), (5, 4, 2, False), (4, 3, None, True)])
def test_no_edge_of_a_full_circuit_runs_over_a_node(layers, heads, kv, parallel):
    """Every edge of the whole graph drawn at once, on deeper and grouped-query layouts than the demo's."""
    import torch

    from entoscope.circuits.figures import circuit_figure
    from entoscope.circuits.graph import Circuit, ComponentGraph

    graph = ComponentGraph(layers, heads, kv, parallel=parallel)
    scores = torch.randn(graph.mask.shape, generator=torch.Generator().manual_seed(0)) * graph.mask
    fig = circuit_figure(Circuit(graph, scores, graph.mask.clone()), max_edges=10_000)
    data = json.loads(fig.to_json())
    assert _check_drawing(data["data"], data["layout"], f"{layers} layers") == graph.n_edges
