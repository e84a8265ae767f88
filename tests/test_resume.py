"""`--resume` verifies every shard before it counts it as done (executors/store.py).

Each case damages the shard folder of an unfinished run (a run of the same command whose shards were all
written and whose saved files were then removed, or a run killed with SIGKILL) and resumes it. The
reference is the uninterrupted run of the same command in one process without any shard folder: the
resumed run's table and per-prompt table must equal it bit for bit, with a warning naming each file
that was computed again, or the run is refused with one line naming the file. The damage is real bytes
on disk (flipped, truncated, swapped, copied from another run), not a mocked reader.
"""

from __future__ import annotations

import os
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from entoscope.cli import main
from entoscope.errors import CheckFailedError
from entoscope.executors import store as store_module
from entoscope.executors.columns import StoredColumns
from entoscope.executors.shards import PerPrompt, Shard

COMMAND = ["patch", "--sites", "{activation: attn_out, over: [layer]}", "--quiet"]
DATA = "{task: ioi, n: 48, seed: 5}"  # 6 batches of 8: 6 shards
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "ENTOSCOPE_QUIET": "1", "OMP_NUM_THREADS": "1"}


def _argv(out: Path, data: str = DATA, command: list[str] = COMMAND) -> list[str]:
    return [*command, "--data", data, "--out", str(out)]


def _unfinished(root: Path, name: str, data: str = DATA, command: list[str] = COMMAND) -> Path:
    """A run folder holding only the shards of a run of the command (all of them): an unfinished run."""
    out = root / name
    assert main(_argv(out, data, command) + ["--resume"]) == 0  # --resume on a new folder writes its shards
    for p in out.iterdir():
        if p.name != "shards":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    reference = root / "reference"
    assert main(_argv(reference)) == 0  # in-process, no shard folder: one shard of every batch
    return {"root": root, "reference": reference, "run": _unfinished(root, "template"),
            "other": _unfinished(root, "other", data="{task: ioi, n: 48, seed: 6}")}


@pytest.fixture
def run(made, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(made["run"], out)
    return out


def _resume(out: Path, monkeypatch) -> tuple[int, list[int]]:
    """Resume the run; (exit status, the shards computed again)."""
    redone: list[int] = []
    real = store_module.ShardStore.write

    def spy(self, phase, shard, part):
        redone.append(shard.id)
        real(self, phase, shard, part)
    monkeypatch.setattr(store_module.ShardStore, "write", spy)
    return main(_argv(out) + ["--resume"]), sorted(redone)


def _same_as_reference(out: Path, reference: Path) -> None:
    for name in ("table.parquet", "per_prompt.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(out / name), pd.read_parquet(reference / name), check_exact=True)
    assert (out / "table.csv").read_bytes() == (reference / "table.csv").read_bytes()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_silently(path: Path, column: str = "patched") -> None:
    """Flip one byte of a column's data page where Parquet still decodes the file, to other values: the
    case only a checksum catches."""
    original = pq.read_table(path)
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema.startswith(column))
    clean = path.read_bytes()
    for offset in range(chunk.data_page_offset + chunk.total_compressed_size - 1, chunk.data_page_offset, -1):
        _flip(path, offset)
        try:
            damaged = pq.read_table(path)
            if damaged.schema.equals(original.schema) and damaged.column(column) != original.column(column):
                return  # read without any error, the same columns, other numbers
        except Exception:  # noqa: BLE001 - this byte breaks the page; try the one before
            pass
        path.write_bytes(clean)
    raise AssertionError("no byte of the data page decodes to other values")


def _warned(capsys, code: str) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if f"[{code}]" in line]


DAMAGE = {
    "flipped byte in a data page": _flip_silently,
    "flipped byte in the footer": lambda p: _flip(p, p.stat().st_size - 60),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "not parquet": lambda p: p.write_bytes(b"PAR1 garbage"),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_shard_is_computed_again_with_a_warning_and_the_table_is_the_uninterrupted_one(
        made, run, monkeypatch, capsys, how):
    target = run / "shards" / "main-00002.parquet"
    DAMAGE[how](target)
    capsys.readouterr()
    status, redone = _resume(run, monkeypatch)
    assert status == 0 and redone == [2]  # only the damaged shard ran again
    warned = _warned(capsys, "shard_damaged")
    assert len(warned) == 1 and str(target) in warned[0]
    _same_as_reference(run, made["reference"])


def test_a_flipped_data_byte_that_parquet_reads_without_error_is_caught_by_the_checksum(run):
    target = run / "shards" / "main-00001.parquet"
    _flip_silently(target)
    pq.read_table(target)  # Parquet alone accepts the file
    with pytest.raises(store_module.ShardDamaged, match="checksum"):
        store_module.open_shard(target)


def test_swapped_shards_of_the_same_run_are_stale_and_computed_again(made, run, monkeypatch, capsys):
    a, b = run / "shards" / "main-00000.parquet", run / "shards" / "main-00003.parquet"
    tmp = a.with_name("swap")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    capsys.readouterr()
    status, redone = _resume(run, monkeypatch)
    assert status == 0 and redone == [0, 3]
    warned = _warned(capsys, "shard_stale")  # said once on stderr, with the count of the others
    assert len(warned) == 2 and "another shard" in warned[0] and "1 more warning" in warned[1]
    recorded = [w["message"] for w in json.loads((run / "manifest.json").read_text())["warnings"]
                if w["code"] == "shard_stale"]  # the run's record names every file
    assert len(recorded) == 2 and {a.name, b.name} == {n for n in (a.name, b.name) for m in recorded if n in m}
    _same_as_reference(run, made["reference"])


def test_a_shard_copied_from_another_run_is_refused_naming_the_file(made, run, monkeypatch, capsys):
    target = run / "shards" / "main-00004.parquet"
    shutil.copy(made["other"] / "shards" / "main-00004.parquet", target)  # same command, another data seed
    before = {p.name: p.read_bytes() for p in (run / "shards").iterdir()}
    capsys.readouterr()
    status, redone = _resume(run, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "[shard_other_run]" in err[0] and str(target) in err[0]
    assert "Remedy:" in err[0] and "--overwrite" in err[0]
    assert {p.name: p.read_bytes() for p in (run / "shards").iterdir()} == before  # nothing replaced or lost
    assert not (run / "manifest.json").exists()
    target.unlink()  # the remedy: remove the file, resume again
    status, redone = _resume(run, monkeypatch)
    assert status == 0 and redone == [4]
    _same_as_reference(run, made["reference"])


@pytest.mark.parametrize("how", ["not json", "deleted", "another shape"])
def test_a_damaged_store_json_is_rebuilt_from_the_verified_shards(made, run, monkeypatch, capsys, how):
    meta = run / "shards" / "store.json"
    if how == "deleted":
        meta.unlink()
    else:
        meta.write_text("{not json" if how == "not json" else "[1, 2]")
    capsys.readouterr()
    status, redone = _resume(run, monkeypatch)
    assert status == 0 and redone == []  # every shard verified by its own record
    assert len(_warned(capsys, "store_rebuilt")) == 1
    _same_as_reference(run, made["reference"])


def test_half_written_files_of_a_killed_driver_are_removed(made, run, monkeypatch):
    partial = run / "shards" / ".main-00005.parquet.0badc0de"
    partial.write_bytes(b"PAR1 half")
    status, redone = _resume(run, monkeypatch)
    assert status == 0 and redone == [] and not partial.exists()
    _same_as_reference(run, made["reference"])


def test_a_damaged_sums_file_recomputes_its_shard(tmp_path, monkeypatch, capsys):
    lens = ["lens", "--sites", "{activation: resid_post, over: [layer]}", "--quiet"]
    data = "{task: ioi, n: 24, seed: 2}"
    reference = tmp_path / "reference"
    assert main(_argv(reference, data, lens)) == 0
    run = _unfinished(tmp_path, "lens", data, lens)
    sums = sorted((run / "shards").glob("*.sums.parquet"))
    assert sums, "the lens keeps sums over its prompts"
    sums[1].write_bytes(sums[1].read_bytes()[:40])
    capsys.readouterr()
    redone = []
    real = store_module.ShardStore.write
    monkeypatch.setattr(store_module.ShardStore, "write",
                        lambda self, phase, shard, part: (redone.append(shard.id), real(self, phase, shard, part)))
    assert main(_argv(run, data, lens) + ["--resume"]) == 0
    assert redone == [1] and any(sums[1].name in w for w in _warned(capsys, "shard_damaged"))
    for name in ("table.parquet", "per_prompt.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(run / name), pd.read_parquet(reference / name), check_exact=True)


@pytest.mark.slow  # the CLI (or the README's script) as a subprocess: the slow set
def test_a_driver_killed_mid_run_resumes_to_the_uninterrupted_table(made, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "entoscope.cli", *_argv(out), "--resume"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "shards").glob("main-*.parquet")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = sorted(p.name for p in (out / "shards").glob("main-*.parquet"))
    assert kept and not (out / "manifest.json").exists(), "the kill came after the run had finished"
    resumed = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    _same_as_reference(out, made["reference"])


def test_the_streamed_merge_refuses_a_shard_changed_after_it_was_verified(tmp_path):
    store = store_module.ShardStore(tmp_path / "shards", "run-a")
    shards = [Shard(0, (0,), (1, 0)), Shard(1, (1,), (2,))]
    rng = np.random.default_rng(0)
    for s in shards:
        store.write("main", s, PerPrompt(list(s.examples), {"x": rng.normal(size=(len(s.examples), 64))}))
    paths = [store.path("main", s) for s in shards]
    expect = [store.identity("main", s) for s in shards]
    merged = StoredColumns(paths, shards, 3, expect)  # sound files merge
    assert merged["x"].shape == (3, 64)
    _flip_silently(paths[1], "x")
    with pytest.raises(CheckFailedError) as err:
        StoredColumns(paths, shards, 3, expect)
    assert err.value.code == "shard_changed" and str(paths[1]) in err.value.message
    other = store_module.ShardStore(tmp_path / "other", "run-b")
    other.write("main", shards[1], PerPrompt([2], {"x": np.zeros((1, 64))}))
    with pytest.raises(Exception) as err:  # a sound file of another run at the merge: refused too
        StoredColumns([paths[0], other.path("main", shards[1])], shards, 3, expect)
    assert getattr(err.value, "code", "") == "shard_other_run"


def test_a_phase_context_dataclass_has_the_digest_of_the_dict_it_replaced():
    """Shard files record their phase context's digest; the typed contexts (steering, circuits, patching: mean)
    digest as the dicts of their fields did, so a shard folder written before resumes after, and any changed
    value still changes the digest."""
    import torch

    from entoscope.circuits.operation import FaithfulnessContext
    from entoscope.executors.shards import digest
    from entoscope.steering.operation import SteerContext

    rng = np.random.default_rng(0)
    vector, random = rng.normal(size=8).astype(np.float32), rng.normal(size=8).astype(np.float32)
    provenance = {"source": "mean_difference", "n_positive": 10}
    steer = SteerContext(vector, random, provenance)
    assert digest(steer) == digest({"vector": vector, "random": random, "provenance": provenance})
    assert digest(steer) != digest(SteerContext(vector, random * 2, provenance))
    # a field added later (R, steering in residual-norm units) changes the digest only when it is set
    assert digest(SteerContext(vector, random, provenance, residual_norm=2.5)) != digest(steer)
    kept = torch.tensor([[[True, False], [False, True]]])
    assert digest(FaithfulnessContext(kept)) == digest({"kept": kept})
    assert digest(FaithfulnessContext(kept)) != digest(FaithfulnessContext(~kept))
