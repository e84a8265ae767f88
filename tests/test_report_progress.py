"""The report says where it is: one line per step as it starts and ends when stdout is not a terminal (a log,
CI), a progress bar when it is, nothing when quiet."""

from __future__ import annotations

import re

import entoscope as es
from entoscope.report import build_report


def test_a_log_gets_a_line_as_each_step_starts_and_ends(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ENTOSCOPE_QUIET", raising=False)
    build_report(es.load_model("demo"), tmp_path / "r", quick=True, sections=["dla", "ifr"])
    lines = capsys.readouterr().out.strip().splitlines()
    steps = [r"checking every section \(no forward\)", "task scores", "section dla", "section ifr", "summary page"]
    expected = [p for i, s in enumerate(steps, 1) for p in (rf"report \[{i}/5\] {s}: started",
                                                          rf"report \[{i}/5\] {s}: done in \d+\.\d s")]
    assert len(lines) == len(expected) and all(re.fullmatch(e, line) for e, line in zip(expected, lines)), lines
    assert (tmp_path / "r" / "index.html").exists()


def test_a_terminal_gets_a_bar_and_quiet_gets_nothing(tmp_path, capsys, monkeypatch):
    from entoscope.report import Progress

    monkeypatch.delenv("ENTOSCOPE_QUIET", raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    bar = Progress(2)
    with bar.step("one"):
        pass
    with bar.step("two"):
        pass
    assert bar.bar is not None and bar.bar.n == 2
    bar.close()
    assert "started" not in capsys.readouterr().out
    quiet = Progress(1, quiet=True)
    with quiet.step("one"):
        pass
    assert quiet.bar is None and capsys.readouterr().out == ""
