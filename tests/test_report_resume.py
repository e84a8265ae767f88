"""An interrupted report goes on where it stopped (report/resume.py): a report process killed after its first
sections leaves them, checked, for the next one; the result equals an uninterrupted report's; a section damaged
on disk is computed again; another model or --quick against full is refused with --resume and replaced
without; leftover partial folders of a destination are taken over or removed, never a live writer's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import entoscope as es
from entoscope.errors import EntoscopeWarning, SaveError
from entoscope.report import build_report

SECTIONS = ["lens", "head_scores", "dla", "ifr"]  # the demo's quick sections that take seconds
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ENTOSCOPE_QUIET": "0",
       "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
CHILD = ("import sys, torch\ntorch.set_num_threads(1)\nimport entoscope as es\nfrom entoscope.report import "
         "build_report\nbuild_report(es.load_model('demo'), sys.argv[1], quick=True, sections=sys.argv[2].split(','))")
DATA = (".csv", ".parquet", ".json", ".graphml")  # what a report computed (pages carry random plot ids and times)


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.fixture(scope="module")
def uninterrupted(demo, tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole") / "r"
    build_report(demo, folder, quick=True, sections=SECTIONS, quiet=True)
    return folder


def _killed_after(out: Path, line: str) -> list[str]:
    """Run the report in a child process and SIGKILL it once it has printed `line` (no cleanup can run)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), ",".join(SECTIONS)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    assert proc.stdout is not None
    for got in proc.stdout:
        seen.append(got.rstrip("\n"))
        if line in got:
            proc.kill()
            break
    proc.wait(timeout=60)
    assert any(line in s for s in seen), seen  # it was killed where asked, not after it ended
    return seen


@pytest.fixture
def killed(tmp_path):
    """A report killed just after its head_scores section finished: (destination, its partial folder)."""
    out = tmp_path / "r"
    _killed_after(out, "section head_scores: done")
    assert not out.exists()
    [partial] = list(tmp_path.glob(".r.partial-*"))
    return out, partial


def _data_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in DATA and p.name != "manifest.json"}


def _same_report(a: Path, b: Path) -> None:
    """Every table, summary, takeaway and graph of two reports byte for byte, and the same files."""
    files_a, files_b = _data_files(a), _data_files(b)
    assert sorted(files_a) == sorted(files_b)
    assert [k for k in files_a if files_a[k] != files_b[k]] == []
    assert sorted(p.relative_to(a).as_posix() for p in a.rglob("*")) == \
        sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))


def test_a_killed_report_goes_on_from_its_finished_sections(killed, uninterrupted, capsys, demo):
    out, partial = killed
    stamps = {p: p.stat().st_mtime_ns for name in ("lens", "head_scores") for p in (partial / name).rglob("*")
              if p.is_file()}
    assert stamps
    build_report(demo, out, quick=True, sections=SECTIONS, resume=True)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.endswith("section lens: reused (finished before the interruption)") for line in lines), lines
    assert any(line.endswith("section head_scores: reused (finished before the interruption)") for line in lines)
    assert any(line.endswith("task scores: reused (finished before the interruption)") for line in lines)
    assert any("section dla: started" in line for line in lines) and any("section ifr: started" in line
                                                                            for line in lines)
    for old, stamp in stamps.items():  # the finished sections' files were not written again
        new = out / old.relative_to(partial)
        assert new.stat().st_mtime_ns == stamp, new
    assert json.loads((out / "manifest.json").read_text())["reused"] == ["task scores", "lens", "head_scores"]
    assert not list(out.parent.glob(".r.partial-*"))
    assert not (out / ".resume").exists()
    _same_report(out, uninterrupted)


def test_a_damaged_section_is_computed_again(killed, uninterrupted, capsys, demo):
    out, partial = killed
    table = partial / "lens" / "table.csv"
    text = table.read_text()
    table.write_text(text.replace("0.", "1.", 1))  # one changed digit: same size, other numbers
    assert table.read_text() != text
    with pytest.warns(EntoscopeWarning, match=r"step 'section lens' cannot be trusted \(a file of its folder"):
        build_report(demo, out, quick=True, sections=SECTIONS)
    lines = capsys.readouterr().out.splitlines()
    assert any("section lens: started" in line for line in lines)
    assert any("section head_scores: reused" in line for line in lines)
    assert json.loads((out / "manifest.json").read_text())["reused"] == ["task scores", "head_scores"]
    _same_report(out, uninterrupted)


def test_a_section_with_a_file_added_or_removed_is_computed_again(killed, capsys, demo):
    out, partial = killed
    (partial / "head_scores" / "table.parquet").unlink()
    (partial / "lens" / "stray.csv").write_text("x\n1\n")
    with pytest.warns(EntoscopeWarning, match="cannot be trusted"):
        build_report(demo, out, quick=True, sections=SECTIONS, quiet=True)
    assert json.loads((out / "manifest.json").read_text())["reused"] == ["task scores"]
    assert (out / "head_scores" / "table.parquet").is_file() and not (out / "lens" / "stray.csv").exists()


def test_other_settings_are_refused_with_resume_and_never_mixed(killed, demo):
    out, partial = killed
    before = {p: p.read_bytes() for p in partial.rglob("*") if p.is_file()}
    with pytest.raises(SaveError) as err:  # the full report against the interrupted --quick one
        build_report(demo, out, quick=False, sections=SECTIONS, resume=True)
    assert err.value.code == "report_resume_mismatch"
    assert "a --quick report and this one the full report" in err.value.message
    other = es.load_model("demo")  # another model: the same one with one weight changed
    import torch

    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1.0
    with pytest.raises(SaveError) as err:
        build_report(other, out, quick=True, sections=SECTIONS, resume=True)
    assert err.value.code == "report_resume_mismatch" and "model" in err.value.message
    assert {p: p.read_bytes() for p in partial.rglob("*") if p.is_file()} == before  # refused: nothing touched
    with pytest.warns(EntoscopeWarning, match="made with other settings"):  # without --resume: a new report
        build_report(other, out, quick=True, sections=["dla", "ifr"], quiet=True)
    assert not partial.exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reused"] == [] and manifest["sections"] == ["dla", "ifr"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dla", "ifr"]


def test_leftover_partial_folders_are_removed_but_not_a_live_writers(tmp_path):
    import fcntl

    from entoscope.results.folder import writing_run

    stale = tmp_path / ".x.partial-stale1"
    (stale / "sub").mkdir(parents=True)
    held = tmp_path / ".x.partial-held01"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer in another process holds its own
    try:
        with writing_run(tmp_path / "x") as folder:
            assert folder.parent == tmp_path and folder.name.startswith(".x.partial-")
            (folder / "manifest.json").write_text("{}")
        assert not stale.exists() and held.is_dir()
        assert sorted(p.name for p in tmp_path.iterdir()) == [".x.partial-held01", "x"]
    finally:
        os.close(fd)


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it, even where pytest runs as a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_sections_and_resume_goes_on(tmp_path):
    """The command line: Ctrl-C after the first sections says they are kept, `--resume` reuses them, and a
    `--resume` of the full report against the interrupted --quick one is refused before any forward."""
    cli = [sys.executable, "-m", "entoscope.cli", "report", "--model", "demo", "--out", str(tmp_path / "r")]
    proc = subprocess.Popen(cli + ["--quick"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    assert proc.stdout is not None
    for got in proc.stdout:
        if "section head_scores: done" in got:
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("entoscope: interrupted; the report's finished steps are kept") and "--resume" in last
    assert not (tmp_path / "r").exists() and len(list(tmp_path.glob(".r.partial-*"))) == 1
    t0 = time.perf_counter()
    full = subprocess.run(cli + ["--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert full.returncode == 2 and "[report_resume_mismatch]" in full.stderr and "report [" not in full.stdout
    assert time.perf_counter() - t0 < 60  # refused before the task scores ran
    done = subprocess.run(cli + ["--quick", "--resume"], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for step in ("task scores", "section lens", "section head_scores"):
        assert f"{step}: reused (finished before the interruption)" in done.stdout
    assert "section dla: started" in done.stdout
    assert (tmp_path / "r" / "index.html").is_file() and not list(tmp_path.glob(".r.partial-*"))
