"""The report never loses finished work: a section the model cannot run is skipped before the first forward, a
section that fails while it runs leaves the others written, and `entoscope run` over several entries keeps the
entries that ran (issue 33, item 4)."""

from __future__ import annotations

import json
import textwrap

import pytest

import entoscope as es
from entoscope import registry
from entoscope.data import tasks
from entoscope.data.tasks import TaskVocabularyError


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _no_two_digit_tokens(events):
    def greater_than(n=64, seed=0, tokenizer=None):
        events.append("greater_than checked")
        raise TaskVocabularyError("task 'greater_than': 100 of the 100 two-digit numbers are not a single token")
    return greater_than


def test_a_section_whose_task_the_tokenizer_cannot_build_is_skipped_before_the_first_forward(tmp_path, demo,
                                                                                              monkeypatch):
    import entoscope.report as report

    events: list[str] = []
    monkeypatch.setitem(tasks.TASKS, "greater_than", _no_two_digit_tokens(events))
    real_scores = report.task_scores

    def scores(model, n):
        events.append("task scores (the first forward)")
        return real_scores(model, n=n)

    monkeypatch.setattr(report, "task_scores", scores)
    with pytest.warns(Warning, match="report_section_skipped|section steering skipped"):
        page = report.build_report(demo, tmp_path / "r", quick=True, sections=["dla", "steering"], quiet=True)
    assert events.index("greater_than checked") < events.index("task scores (the first forward)")
    folder = tmp_path / "r"
    assert page.exists() and (folder / "dla" / "table.csv").exists()  # the other section is written
    assert not (folder / "steering" / "table.csv").exists()
    note = (folder / "steering" / "index.html").read_text()
    assert "task_vocabulary" in note and "two-digit numbers" in note and "Remedy" in note
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["written"] == ["dla"]
    [skipped] = manifest["not_run"]
    assert skipped["section"] == "steering" and skipped["status"] == "skipped" and skipped["code"] == "task_vocabulary"
    index = page.read_text()
    assert "sections not run" in index and "task_vocabulary" in index
    assert json.loads((folder / "scores.json").read_text())["greater_than"]["skipped"] == 1.0


def test_a_section_raising_mid_run_leaves_the_others_written(tmp_path, demo, monkeypatch):
    from entoscope.report import build_report

    def boom(model, folder, quick):
        folder.mkdir(parents=True)
        (folder / "half_written.csv").write_text("a\n1\n")
        raise RuntimeError("boom at layer 3")

    monkeypatch.setitem(registry._REGISTRY["report_section"], "boom", boom)  # gone after the test
    with pytest.warns(Warning, match="boom"):
        page = build_report(demo, tmp_path / "r", quick=True, sections=["dla", "boom", "ifr"], quiet=True)
    folder = tmp_path / "r"
    assert (folder / "dla" / "table.csv").exists() and (folder / "ifr" / "table.csv").exists()
    assert not (folder / "boom" / "half_written.csv").exists()  # a failed section's files are not kept
    assert "RuntimeError: boom at layer 3" in (folder / "boom" / "index.html").read_text()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["written"] == ["dla", "ifr"]
    assert manifest["not_run"][0]["status"] == "failed" and manifest["not_run"][0]["code"] == "internal_error"
    assert "boom" in page.read_text() and "failed" in page.read_text()


def test_run_over_entries_keeps_the_entries_that_ran_and_exits_2(tmp_path, capsys):
    from entoscope.cli import main

    spec = tmp_path / "exp.yaml"
    spec.write_text(textwrap.dedent("""
        good:
          operation: dla
          data: {task: ioi, n: 4}
        bad:
          operation: dla
          data: {prompts: ["When Mary and John went to the store, John gave a drink to"]}
        also_good:
          operation: lens
          data: {task: ioi, n: 4}
    """))
    rc = main(["run", str(spec), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "entry bad" in err and "[entries_failed] 1 of 3 entries failed: bad" in err
    assert (tmp_path / "out" / "good" / "manifest.json").exists()
    assert (tmp_path / "out" / "also_good" / "manifest.json").exists()
    assert not (tmp_path / "out" / "bad").exists()
