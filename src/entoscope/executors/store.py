"""The shard store: one Parquet file per finished shard, in the run folder (`RUN/shards/`), each proving what it is.

    shards/store.json             what run the shards belong to (a digest of the operation's config, the
                                  data, the model's fingerprint and the shard plan) and, per phase, the
                                  digest of the driver's context (e.g. the circuit chosen between phases)
    shards/<phase>-00003.parquet  one row per prompt of shard 3: `example`, then one column per array
                                  (arrays of more than one axis as fixed-size lists; shapes in the metadata);
                                  written last, so its presence means the shard is complete
    shards/<phase>-00003.sums.parquet   its sums over its prompts, where it has them

Each shard file carries its own record in the Parquet schema metadata (`entoscope_shard`): the run's
digest, the phase and its context digest, the shard's number and a digest of its prompts (its
identity), the SHA-256 of its values (every array's dtype, shape and bytes, as read back) and of its
sums file, and a seal (the SHA-256 of all of that). Parquet's own page checksums are optional, so a
flipped byte in a data page may decode to other numbers without any error: the content digest is what
catches it. `--resume` counts a shard as done only once it is verified:

    unreadable, truncated, seal or checksum wrong   damaged: removed and computed again (warning shard_damaged)
    this run, another shard / phase context         stale: removed and computed again (warning shard_stale)
    a sound file of another run                     refused (shard_other_run): never merged, never replaced

A store.json that cannot be read is rebuilt from this run's key (warning store_rebuilt): nothing in it
is needed to trust a shard, since every shard names its own run. The streamed merge
(columns.StoredColumns) verifies every file again as it reads it, so what is merged is what was verified.

Files are written beside and renamed into place, so a killed driver leaves only whole shards (and
hidden partial files, removed on resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckFailedError, SaveError, warn
from .shards import PerPrompt, Shard, digest

STORE_FILE = "store.json"
RECORD_KEY = b"entoscope_shard"
RECORD_FORMAT = 1


class ShardDamaged(Exception):
    """A shard file that cannot be trusted: unreadable, truncated, or its values differ from its record."""


class ShardStale(Exception):
    """A sound shard file of this run that belongs to another shard, phase or phase context."""


class ShardStore:
    def __init__(self, folder: str | Path, run_key: str, *, resume: bool = False) -> None:
        self.folder = Path(folder)
        self.run_key = run_key
        meta = self.folder / STORE_FILE
        self._verified: set[tuple[str, int]] = set()
        if meta.exists() or self.files():
            if not resume:
                raise SaveError(f"{self.folder} holds the shards of an unfinished run", code="run_unfinished",
                                remedy="resume it (--resume; Python: resume=True), or start again (--overwrite; "
                                "Python: delete the folder)")
            stored, why = _read_meta(meta)
            if stored is None:
                warn(f"{meta} {why}; rebuilt: every shard is verified against its own record of its run",
                     code="store_rebuilt")
                self.meta = {"run": run_key, "phases": {}}
                self._save_meta()
            elif stored["run"] != run_key:
                raise SaveError(f"{self.folder} holds shards of a different run (operation config, data, model or "
                                "shard plan changed)", code="resume_mismatch",
                                remedy="resume with exactly the same command, or start again with --overwrite")
            else:
                self.meta = stored
            for partial in self.folder.glob(".*"):  # a killed driver's half-written files (see _write)
                if partial.is_file() and (".parquet." in partial.name or partial.name.startswith(f".{STORE_FILE}.")):
                    partial.unlink(missing_ok=True)
        else:
            self.meta = {"run": run_key, "phases": {}}
            self.folder.mkdir(parents=True, exist_ok=True)
            self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.folder / f".{STORE_FILE}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(self.meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.folder / STORE_FILE)

    def begin_phase(self, phase: str, context: str) -> None:
        """Record this phase's context digest (a shard made under another context is stale)."""
        if self.meta["phases"].get(phase) != context:
            self.meta["phases"][phase] = context
            self._verified = {v for v in self._verified if v[0] != phase}
            self._save_meta()

    def path(self, phase: str, shard: Shard) -> Path:
        return self.folder / f"{phase}-{shard.id:05d}.parquet"

    def identity(self, phase: str, shard: Shard) -> dict[str, Any]:
        """What a shard file must say it is to count as this run's shard `shard` of `phase`."""
        return {"format": RECORD_FORMAT, "run": self.run_key, "phase": phase,
                "context": self.meta["phases"].get(phase), "shard": shard.id,
                "examples": digest(list(shard.examples))}

    def has(self, phase: str, shard: Shard) -> bool:
        """Whether the shard is on disk and verified; a damaged or stale file is removed (with a warning)."""
        if (phase, shard.id) in self._verified:
            return True
        path = self.path(phase, shard)
        if not path.exists():
            return False
        try:
            open_shard(path, self.identity(phase, shard))
        except ShardDamaged as err:
            warn(f"shard file {path} is damaged ({err}); it is computed again", code="shard_damaged")
        except ShardStale as err:
            warn(f"shard file {path} {err}; it is computed again", code="shard_stale")
        else:
            self._verified.add((phase, shard.id))
            return True
        path.unlink(missing_ok=True)
        path.with_suffix(".sums.parquet").unlink(missing_ok=True)
        return False

    def files(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("*.parquet")) if self.folder.is_dir() else []

    def write(self, phase: str, shard: Shard, part: PerPrompt) -> None:
        if sorted(part.examples.tolist()) != sorted(shard.examples):
            raise SaveError(f"shard {shard.id} returned other prompts than it was given", code="shard_rows_mismatch",
                            remedy="this is a bug in the operation's execute_shard; report it")
        target = self.path(phase, shard)
        sums_digest = None
        if part.sums:
            sums = to_arrow(PerPrompt([0], {k: np.asarray(v)[None] for k, v in part.sums.items()}))
            sums_digest = content_digest(sums)
            _write(sums, target.with_suffix(".sums.parquet"))
        table = to_arrow(part)
        record = {**self.identity(phase, shard), "content": content_digest(table), "sums": sums_digest}
        record["seal"] = _seal(record)
        _write(table.replace_schema_metadata({**table.schema.metadata, RECORD_KEY: json.dumps(record)}), target)
        self._verified.add((phase, shard.id))

    def read(self, phase: str, shard: Shard) -> PerPrompt:
        """The shard's arrays and sums, verified (a damaged or stale file: CheckFailedError shard_changed)."""
        path = self.path(phase, shard)
        try:
            table, sums = open_shard(path, self.identity(phase, shard))
        except (ShardDamaged, ShardStale) as err:
            raise changed(path, err) from None
        part = from_arrow(table)
        part.sums = sums
        return part

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def changed(path: Path, err: Exception) -> CheckFailedError:
    """A shard that was verified (or just written) and no longer is: refused, never merged."""
    return CheckFailedError(f"shard file {path} changed after it was verified ({err}); nothing was merged",
                            code="shard_changed", remedy="make sure no other process writes the run's shards "
                            "folder, then run the same command with --resume (the shard is computed again)")


def open_shard(path: Path, expect: dict[str, Any] | None = None) -> tuple[Any, dict[str, np.ndarray] | None]:
    """(Arrow table, sums) of a shard file whose record, seal and content digests hold.

    ShardDamaged: the file (or its sums file) cannot be read or does not match its own record.
    With `expect` (ShardStore.identity): SaveError shard_other_run for a sound file of another run,
    ShardStale for one of this run that is another shard, phase or context."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        meta = table.schema.metadata or {}
    except Exception as err:  # noqa: BLE001 - truncated / damaged Parquet raises ArrowInvalid, OSError, ...
        raise ShardDamaged(f"unreadable: {_why(err)}") from None
    if RECORD_KEY not in meta:
        raise ShardDamaged("it has no entoscope record of its run (written by an older entoscope?)")
    try:
        record = json.loads(meta[RECORD_KEY])
        sealed = isinstance(record, dict) and record.get("seal") == _seal(record)
    except (ValueError, UnicodeDecodeError):
        sealed = False
    if not sealed:
        raise ShardDamaged("its record does not match its seal")
    try:
        content = content_digest(table)
    except Exception as err:  # noqa: BLE001 - a damaged page or shape record
        raise ShardDamaged(f"its values cannot be decoded: {_why(err)}") from None
    if content != record.get("content"):
        raise ShardDamaged("its values differ from the checksum written with them")
    sums = None
    sums_path = path.with_suffix(".sums.parquet")
    if record.get("sums") is not None:
        try:
            sums_table = pq.read_table(sums_path)
            ok = content_digest(sums_table) == record["sums"]
        except Exception as err:  # noqa: BLE001
            raise ShardDamaged(f"its sums file {sums_path.name} is unreadable: {_why(err)}") from None
        if not ok:
            raise ShardDamaged(f"its sums file {sums_path.name} differs from the checksum written with it")
        sums = {k: v[0] for k, v in from_arrow(sums_table).arrays.items()}
    if expect is not None:
        if record.get("run") != expect["run"]:
            raise SaveError(f"shard file {path} belongs to another run (its record names run {record.get('run')}, "
                            f"this run is {expect['run']}): it was copied or moved here from another run folder",
                            code="shard_other_run", remedy=f"remove {path} (this run computes it again), or "
                            "start again with --overwrite")
        wrong = [k for k in ("format", "phase", "context", "shard", "examples") if record.get(k) != expect[k]]
        if wrong:
            raise ShardStale(f"is a sound file of this run made for another {' and '.join(wrong)}")
    return table, sums


def read_sums(target: Path) -> dict[str, np.ndarray] | None:
    """The sums a shard file's companion (.sums.parquet) holds, verified; None if it has none."""
    return open_shard(target)[1]


def content_digest(table: Any) -> str:
    """SHA-256 of a shard table as entoscope reads it back: its columns' Arrow types, the prompts, then
    every array's name, dtype, shape and bytes (object arrays: their values' repr)."""
    part = from_arrow(table)
    h = hashlib.sha256()
    h.update(";".join(f"{f.name}:{_type_key(f.type)}" for f in table.schema).encode())
    h.update(np.ascontiguousarray(part.examples, dtype=np.int64).tobytes())
    for key in sorted(part.arrays):
        arr = np.ascontiguousarray(part.arrays[key])
        h.update(f"|{key}|{arr.dtype}|{arr.shape}|".encode())
        h.update(repr(arr.tolist()).encode() if arr.dtype == object else arr.tobytes())
    return h.hexdigest()


def _type_key(t: Any) -> str:
    """An Arrow type without its list child's name (Parquet reads `item` back as `element`)."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list[{t.list_size}]<{_type_key(t.value_type)}>"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type_key(t.value_type)}>"
    return str(t)


def _seal(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "seal"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"


def _read_meta(path: Path) -> tuple[dict[str, Any] | None, str]:
    """store.json's contents, or (None, what is wrong with it)."""
    if not path.exists():
        return None, "is missing"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as err:
        return None, f"cannot be read ({_why(err)})"
    if not (isinstance(stored, dict) and isinstance(stored.get("run"), str) and isinstance(stored.get("phases"), dict)
            and all(isinstance(v, (str, type(None))) for v in stored["phases"].values())):
        return None, "is not a shard store record (no run and phases)"
    return stored, ""


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
