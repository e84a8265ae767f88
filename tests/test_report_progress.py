"""The report says where it is: one line per step as it starts and ends when stdout is not a terminal (a log,
CI), a progress bar when it is, nothing when quiet."""

from __future__ import annotations

import re

import pytest

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


# a child that writes a quick report of DLA then a section that only waits 4 s: a line the report printed after DLA
# must reach the log while the child still runs, not when it ends
PAUSED = """
import sys, time, torch
torch.set_num_threads(1)
import entoscope as es
from entoscope.registry import register
from entoscope.report import build_report
from entoscope.report.section import Section

@register("report_section", "pause")
def pause(model, folder, quick):
    folder.mkdir(parents=True, exist_ok=True)
    time.sleep(4)
    return Section("a pause", "It waited.", "<p>waited</p>", own_page=False)

build_report(es.load_model("demo"), sys.argv[1], quick=True, sections=["dla", "pause"])
"""


def _child_env():
    import os
    from pathlib import Path

    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ENTOSCOPE_QUIET": "0",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


def _wait_for(read, proc, needle: bytes, timeout: float = 240.0) -> bytes:
    """What `read()` gave until `needle` followed by a line end appeared; fails if the child ended first."""
    import time

    got, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        got += read()
        at = got.find(needle)
        if at >= 0 and b"\n" in got[at:]:
            return got
        assert proc.poll() is None, f"the child ended before {needle!r} reached its log: {got[-2000:]!r}"
        time.sleep(0.05)
    raise AssertionError(f"no {needle!r} within {timeout} s: {got[-2000:]!r}")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "pipe", "terminal"])
def test_each_step_reaches_a_log_while_the_report_runs(tmp_path, where):
    """stdout a file, a pipe, or a pseudo-terminal (a log captured through a terminal, as `script` does): each
    finished step's line, with its time, arrives as a whole line while the report is still running."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-c", PAUSED, str(tmp_path / "r")]
    env = {**_child_env(), "TERM": "xterm"}
    if where == "file":
        log = tmp_path / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env)
        fd = os.open(log, os.O_RDONLY)
    elif where == "pipe":
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
    else:
        import pty

        fd, slave = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, env=env)
        os.close(slave)
        os.set_blocking(fd, False)

    def read() -> bytes:
        try:
            return os.read(fd, 65536)
        except (BlockingIOError, OSError):
            return b""

    try:
        got = _wait_for(read, proc, b"section dla: done in")
        assert re.search(rb"report \[3/5\] section dla: done in \d+\.\d s", got), got[-2000:]
        assert proc.poll() is None  # the pause is still running: the line came as it was printed
    finally:
        proc.wait(timeout=120)
        if where != "pipe":
            os.close(fd)
    assert proc.returncode == 0
    assert (tmp_path / "r" / "index.html").exists()
