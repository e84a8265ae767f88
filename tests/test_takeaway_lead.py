"""A takeaway's lead and details (results/claims.py, docs/pages.md "A takeaway first"): the text up to
`end_lead()` and the rest, written by hand here; claims' spans stay valid in the whole text, joined takeaways put
every lead first, and pages show the lead in the lead box with the details just below."""

from __future__ import annotations

import html
import json
import re

import pandas as pd
import pytest

from entoscope.results.claims import Takeaway, TakeawayBuilder, join, split_lead, write_takeaways
from entoscope.results.page import write_page


def _spans_hold(t: Takeaway) -> None:
    for c in t.claims:
        assert str(t)[c.start:c.start + len(c.text)] == c.text, c


def _one(value: float, rest: float) -> Takeaway:
    b = TakeawayBuilder(key="site")
    word = b.qualify("most", "most")
    b.say(" of it sits at ")
    first = b.quote({"site": "a1", "v": value}, "v")
    b.say(". ")
    b.end_lead()
    b.say("Next: ")
    b.quote({"site": "b2", "v": rest}, "v")
    b.say(".")
    b.refer(word, [first])
    return b.build()


def test_the_lead_is_the_text_up_to_the_mark_and_the_details_the_rest():
    t = _one(0.75, 0.25)
    assert str(t) == "most of it sits at a1 0.75. Next: b2 0.25."
    assert (t.lead, t.details) == ("most of it sits at a1 0.75.", "Next: b2 0.25.")
    assert t.lead_end == len("most of it sits at a1 0.75. ")
    _spans_hold(t)
    assert split_lead("plain words") == ("plain words", "")  # unmarked: all lead
    assert Takeaway("no mark").lead == "no mark" and Takeaway("no mark").details == ""
    with pytest.raises(ValueError):
        TakeawayBuilder().end_lead().end_lead()


def test_joined_takeaways_put_every_lead_first_and_keep_every_claim_and_reference():
    a, b = _one(0.75, 0.25), _one(0.6, 0.1)
    j = join([a, b], labels=["A: ", "B: "], prefixes=["x", "y"])
    assert j.lead == "A: most of it sits at a1 0.75. B: most of it sits at a1 0.60."
    assert j.details == "A: Next: b2 0.25. B: Next: b2 0.10."
    assert str(j) == j.lead + " " + j.details
    _spans_hold(j)
    assert len(j.claims) == 6 and [c.source for c in j.claims] == ["x/table.csv"] * 3 + ["y/table.csv"] * 3
    for c in j.claims:  # each "most" still refers to its own takeaway's first cell
        if c.type == "qualifier":
            assert [j.claims[r].text for r in c.refs] == ["a1 0.75" if c.source.startswith("x") else "a1 0.60"]


def test_takeaway_json_records_the_mark_and_a_page_shows_lead_then_details(tmp_path):
    t = _one(0.75, 0.25)
    write_takeaways(tmp_path / "takeaway.json", [("index.html", t)])
    [entry] = json.loads((tmp_path / "takeaway.json").read_text())
    assert entry["text"] == str(t) and entry["lead_end"] == t.lead_end
    page = write_page(tmp_path / "index.html", "p", [("table", "<p>x</p>")], lead=t).read_text()
    m = re.search(r'<p class="lead">(.*?)</p><p class="details">(.*?)</p>', page)
    assert m and (html.unescape(m.group(1)), html.unescape(m.group(2))) == (t.lead, t.details)


def test_a_saved_run_reopens_with_its_lead_mark(tmp_path):
    import entoscope as es

    demo = es.load_model("demo")
    r = es.DirectLogitAttribution().run(demo, {"task": "ioi", "n": 6, "seed": 1}, quiet=True)
    assert r.takeaway.lead and r.takeaway.details and str(r.takeaway).startswith(r.takeaway.lead)
    loaded = es.Result.load(r.save(tmp_path / "run"))
    assert str(loaded.takeaway) == str(r.takeaway) and loaded.takeaway.lead == r.takeaway.lead
    assert isinstance(pd.read_csv(tmp_path / "run" / "table.csv"), pd.DataFrame)
