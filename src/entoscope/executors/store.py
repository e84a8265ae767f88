"""The shard store: one Parquet file per finished shard, in the run folder (`RUN/shards/`).

    shards/store.json             what run the shards belong to (a digest of the operation's config, the
                                  data, the model's fingerprint and the shard plan) and, per phase, the
                                  digest of the driver's context (e.g. the circuit chosen between phases)
    shards/<phase>-00003.parquet  one row per prompt of shard 3: `example`, then one column per array
                                  (arrays of more than one axis as fixed-size lists; shapes in the metadata);
                                  written last, so its presence means the shard is complete
    shards/<phase>-00003.sums.parquet   its sums over its prompts, where it has them

Files are written beside and renamed into place, so a killed driver leaves only whole shards; a resumed
run (`--resume`) checks store.json and skips the shards already there. A store whose run differs is
refused rather than mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SaveError
from .shards import PerPrompt, Shard

STORE_FILE = "store.json"


class ShardStore:
    def __init__(self, folder: str | Path, run_key: str, *, resume: bool = False) -> None:
        self.folder = Path(folder)
        self.run_key = run_key
        meta = self.folder / STORE_FILE
        if meta.exists():
            stored = json.loads(meta.read_text())
            if not resume:
                raise SaveError(f"{self.folder} holds the shards of an unfinished run", code="run_unfinished",
                                remedy="resume it (--resume; Python: resume=True), or start again (--overwrite; "
                                "Python: delete the folder)")
            if stored.get("run") != run_key:
                raise SaveError(f"{self.folder} holds shards of a different run (operation config, data, model or "
                                "shard plan changed)", code="resume_mismatch",
                                remedy="resume with exactly the same command, or start again with --overwrite")
            self.meta = stored
        else:
            self.meta = {"run": run_key, "phases": {}}
            self.folder.mkdir(parents=True, exist_ok=True)
            self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.folder / f".{STORE_FILE}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(self.meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.folder / STORE_FILE)

    def begin_phase(self, phase: str, context: str) -> None:
        """Record this phase's context digest; shards of the phase made under another context are dropped."""
        phases = self.meta["phases"]
        if phases.get(phase) != context:
            for f in self.folder.glob(f"{phase}-*.parquet"):
                f.unlink()
            phases[phase] = context
            self._save_meta()

    def path(self, phase: str, shard: Shard) -> Path:
        return self.folder / f"{phase}-{shard.id:05d}.parquet"

    def has(self, phase: str, shard: Shard) -> bool:
        return self.path(phase, shard).exists()

    def files(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("*.parquet"))

    def write(self, phase: str, shard: Shard, part: PerPrompt) -> None:
        if sorted(part.examples.tolist()) != sorted(shard.examples):
            raise SaveError(f"shard {shard.id} returned other prompts than it was given", code="shard_rows_mismatch",
                            remedy="this is a bug in the operation's execute_shard; report it")
        target = self.path(phase, shard)
        if part.sums:
            _write(to_arrow(PerPrompt([0], {k: np.asarray(v)[None] for k, v in part.sums.items()})),
                   target.with_suffix(".sums.parquet"))
        _write(to_arrow(part), target)

    def read(self, phase: str, shard: Shard) -> PerPrompt:
        import pyarrow.parquet as pq

        target = self.path(phase, shard)
        part = from_arrow(pq.read_table(target))
        if sorted(part.examples.tolist()) != sorted(shard.examples):
            raise SaveError(f"{target} holds other prompts than its shard", code="resume_mismatch",
                            remedy="start again with --overwrite")
        part.sums = read_sums(target)
        return part

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def read_sums(target: Path) -> dict[str, np.ndarray] | None:
    """The sums a shard file's companion (.sums.parquet) holds, or None."""
    import pyarrow.parquet as pq

    path = target.with_suffix(".sums.parquet")
    if not path.exists():
        return None
    return {k: v[0] for k, v in from_arrow(pq.read_table(path)).arrays.items()}


def _write(table: Any, target: Path) -> None:
    import pyarrow.parquet as pq

    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise SaveError(f"writing shard {target} failed ({err.strerror or err})",
                        remedy="free some disk space, then resume the run (--resume)") from None


def to_arrow(part: PerPrompt) -> Any:
    """A PerPrompt as an Arrow table: `example`, then one column per array (trailing axes flattened)."""
    import pyarrow as pa

    columns = {"example": pa.array(part.examples)}
    shapes = {}
    for key, arr in part.arrays.items():
        arr = np.asarray(arr)
        shapes[key] = {"shape": list(arr.shape[1:]), "dtype": str(arr.dtype)}
        if arr.ndim == 1:
            columns[key] = pa.array(arr.tolist() if arr.dtype == object else arr)
        else:
            width = int(np.prod(arr.shape[1:]))
            flat = np.ascontiguousarray(arr).reshape(-1)
            columns[key] = pa.FixedSizeListArray.from_arrays(pa.array(flat), width)
    table = pa.table(columns)
    return table.replace_schema_metadata({"entoscope": json.dumps(shapes)})


def from_arrow(table: Any) -> PerPrompt:
    shapes = json.loads(table.schema.metadata[b"entoscope"])
    arrays = {}
    n = table.num_rows
    for key, info in shapes.items():
        col = table.column(key).combine_chunks()
        if not info["shape"]:
            arr = np.asarray(col.to_pylist(), dtype=object) if info["dtype"] == "object" else col.to_numpy(zero_copy_only=False)
        else:
            arr = col.flatten().to_numpy(zero_copy_only=False).reshape([n, *info["shape"]])
        arrays[key] = arr.astype(info["dtype"], copy=False) if info["dtype"] != "object" else arr
    return PerPrompt(table.column("example").to_numpy(), arrays)
