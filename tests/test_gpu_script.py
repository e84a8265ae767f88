"""The prepared device script (benchmarks/gpu/run.py) on its CPU path, so that it cannot rot between the
times a GPU is lent: the demo model on the CPU in float32 (the reference) and in bfloat16, every operation,
each bfloat16 table compared with the float32 one within the tolerances of benchmarks/gpu/cases.py, and the
timings against the floor at a small size.

The script's comparisons are the checks; these tests check that they run, that every operation is in the
JSON, and that they can fail: a tolerance set to 0 fails the script, with a difference that a computation
made here (DLA in both dtypes, joined by component) confirms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
    [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
ENV.pop("ENTOSCOPE_GPU_TOLERANCE", None)


def _run(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size", "small", "--models", "demo",
                           "--out", str(out), *args], capture_output=True, text=True, env={**ENV, **(env or {})},
                          timeout=600)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc, report


def _case_names() -> set[str]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from cases import cases
        return {c.name for c in cases()}
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.slow
def test_cpu_path_runs_every_operation_green(tmp_path: Path) -> None:
    proc, report = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = report["comparisons"]
    assert {r["operation"] for r in rows} == _case_names()  # every operation, run or skipped with its reason
    compared = {r["operation"] for r in rows if r["dtype"] == "bfloat16"}
    skipped = {r["operation"]: r["note"] for r in rows if r["status"] == "skipped"}
    assert compared | set(skipped) == _case_names()
    assert not skipped, skipped  # every operation runs on the demo model (interchange included)
    assert "interchange" in compared
    for r in rows:
        if r["dtype"] == "bfloat16":
            assert r["status"] == "ok" and 0 <= r["err"] <= r["tol"], r  # within its tolerance
            # bfloat16 moves every number (a probe's accuracy over 24 prompts, or an IIA over 16 pairs, both
            # counts, may well stay where they were)
            assert r["err"] > 0 or r["operation"] in ("probing", "interchange"), r
    assert {t["name"] for t in report["timings"]} == {"eap_ig", "exact_sweep"}
    for t in report["timings"]:
        assert t["seconds"] > 0 and t["floor_seconds"] > 0 and t["n"] == 16, t
        assert t["backward_passes"] == (t["floor_backwards"] if t["name"] == "eap_ig" else 0), t
    assert report["failures"] == 0 and "0 failure(s)" in proc.stdout


@pytest.mark.slow
def test_a_tolerance_of_zero_fails_with_the_numbers(tmp_path: Path) -> None:
    """--tolerance dla=0 and ENTOSCOPE_GPU_TOLERANCE=head_scores=0 each fail their operation; the third one
    run beside them (IFR) keeps its tolerance and passes."""
    proc, report = _run(tmp_path, "--only", "dla,head_scores,ifr", "--timings", "off", "--tolerance", "dla=0",
                        env={"ENTOSCOPE_GPU_TOLERANCE": "head_scores=0"})
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["operation"]: r for r in report["comparisons"] if r["dtype"] == "bfloat16"}
    assert {k: r["status"] for k, r in rows.items()} == {"dla": "FAIL", "head_scores": "FAIL", "ifr": "ok"}
    assert report["tolerance_overrides"] == {"dla": 0.0, "head_scores": 0.0} and report["failures"] == 2
    row = rows["dla"]
    assert row["tol"] == 0 and row["where"].startswith("table.mean at component=")
    assert "FAIL demo dla bfloat16" in proc.stdout and "FAIL demo head_scores bfloat16" in proc.stdout

    # the difference the script reports, computed here: DLA of the demo model in both dtypes, by component
    import entoscope as es

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from cases import STATS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    data = es.tasks.ioi(n=8, seed=1)
    tables = [es.DirectLogitAttribution(stats=STATS).run(es.load_model("demo", dtype=d), data, quiet=True).table
              .set_index("component")["mean"] for d in ("float32", "bfloat16")]
    ref, got = tables[0], tables[1].reindex(tables[0].index)
    diff = np.abs(ref.to_numpy() - got.to_numpy())
    assert row["abs_diff"] == pytest.approx(diff.max(), rel=1e-9)
    assert row["err"] == pytest.approx(diff.max() / np.abs(ref.to_numpy()).max(), rel=1e-9)
    assert f"component={ref.index[int(np.argmax(diff))]}," in row["where"]
