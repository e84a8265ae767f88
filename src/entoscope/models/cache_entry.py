"""The on-disk format of a `CachedModel` entry: one safetensors file, written atomically, read back checked.

An entry is `<cache_dir>/<model folder>/<base>-<names>.safetensors` (see cache_key.py for the two
digests). Each file is a valid safetensors file whose metadata (under the "entoscope" key) says what
it holds and carries a CRC-32 of each tensor's bytes; nothing in it executes. A writer writes a
temporary file next to the entry and renames it over; `sweep_stale_temps` removes the temporary
files a killed writer left behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .fingerprint import tensor_bytes


FORMAT_VERSION = 1
"""Version of the entry layout. It is part of every digest and of every file's metadata: an entry
written by a release that stored things differently is never looked up, and if found is recomputed."""

_SUFFIX = ".safetensors"
_META_KEY = "entoscope"
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                     ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _ST_DTYPES}


class CorruptEntry(Exception):
    """An entry file that cannot be trusted (truncated, garbage, other format, wrong digest)."""


def write_entry(path: Path, arrays: dict[str, Tensor], meta: dict[str, Any]) -> int:
    """Write a safetensors file atomically; `meta` gains the checksums. Returns the bytes written.

    The temporary file's name is unique per process, thread and call; it is fsynced, then renamed
    over `path` (atomic on POSIX and Windows), so a reader sees the old file or the new one, never
    a part. Tensors go largest element first, so every one is aligned in the file. Each tensor's
    bytes get a CRC-32 in the metadata, so a reader can verify just the tensors it reads.
    """
    order = sorted(arrays, key=lambda k: (-arrays[k].element_size(), k))
    header: dict[str, Any] = {}
    chunks = []
    crcs = {}
    offset = 0
    for name in order:
        t = arrays[name]
        raw = memoryview(tensor_bytes(t))
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        crcs[name] = zlib.crc32(raw)
        chunks.append(raw)
    meta = dict(meta, crc32=crcs, data_bytes=offset)
    header["__metadata__"] = {_META_KEY: json.dumps(meta, sort_keys=True, separators=(",", ":"))}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for raw in chunks:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return 8 + len(hb) + offset


_HOST = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"
_TEMP = re.compile(r"^\..+\.safetensors\.(?:(?P<host>[A-Za-z0-9_-]+)\.)?(?P<pid>\d+)\.\d+\.[0-9a-f]+\.tmp$")
STALE_AFTER_S = 600.0  # a temp file this old whose writer is gone is left over from a killed process
STALE_OTHER_HOST_S = 86400.0  # a writer on another host (shared storage) cannot be asked: wait a day


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def sweep_stale_temps(folder: Path, now: float | None = None) -> tuple[int, int]:
    """Remove the temp files killed writers left in `folder`: (removed, still in progress).

    A temp file is stale when it is older than STALE_AFTER_S and its writer (pid in its name, on
    this host) is no longer alive, or, when written from another host, older than a day.
    """
    import time

    now = time.time() if now is None else now
    removed = live = 0
    if not folder.is_dir():
        return 0, 0
    for e in os.scandir(folder):
        m = _TEMP.match(e.name)
        if not m:
            continue
        try:
            age = now - e.stat().st_mtime
        except FileNotFoundError:
            continue
        host = m.group("host") or _HOST
        gone = not _pid_alive(int(m.group("pid"))) if host == _HOST else age > STALE_OTHER_HOST_S
        if gone and age > STALE_AFTER_S:
            try:
                os.unlink(e.path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                live += 1
        else:
            live += 1
    return removed, live


def _read_header(f: Any, size: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(start of the data, safetensors header, our metadata) of an open entry, checked for length."""
    head = f.read(8)
    if len(head) < 8:
        raise CorruptEntry(f"{size} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > 100_000_000:
        raise CorruptEntry(f"header length {n} runs past the end of a {size}-byte file")
    raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptEntry(f"unreadable header ({type(err).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CorruptEntry(f"entry format {meta.get('format') if isinstance(meta, dict) else '?'}, "
                           f"this release reads {FORMAT_VERSION}")
    if size != 8 + n + meta.get("data_bytes", -1):
        raise CorruptEntry(f"{size} bytes on disk, the header says {8 + n + meta.get('data_bytes', -1)}")
    return 8 + n, header, meta


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of an entry, reading its header only (for the subset index)."""
    with open(path, "rb") as f:
        return _read_header(f, os.fstat(f.fileno()).st_size)[2]


def read_entry(path: Path, digest: str, select: Callable[[dict[str, Any]], set[str] | None] | None = None
               ) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """(metadata, tensors, bytes read) of an entry, every tensor read checked against its CRC-32.

    `select(meta)`: the names of the tensors to read (a subset answer needs a few of a large
    entry's), None for all. Raises CorruptEntry for anything that does not add up: size, header,
    format, digest, offsets, checksums.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start, header, meta = _read_header(f, size)
        if meta.get("digest") != digest:
            raise CorruptEntry(f"holds digest {meta.get('digest')!r}, not {digest!r}")
        only = select(meta) if select is not None else None
        crcs = meta.get("crc32")
        if not isinstance(crcs, dict):
            raise CorruptEntry("no checksums")
        records: list[tuple[str, torch.dtype, list[int], int, int]] = []
        try:
            for name, info in header.items():
                if name == "__metadata__" or (only is not None and name not in only):
                    continue
                dtype = _TORCH_DTYPES[info["dtype"]]
                shape = [int(x) for x in info["shape"]]
                lo, hi = (int(x) for x in info["data_offsets"])
                numel = 1
                for x in shape:
                    numel *= x
                if not 0 <= lo <= hi <= size - start or hi - lo != numel * _ITEMSIZE[dtype]:
                    raise CorruptEntry(f"tensor {name}: offsets {lo}..{hi} do not fit {shape} {dtype}")
                records.append((name, dtype, shape, lo, hi))
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptEntry(f"bad tensor record ({type(err).__name__}: {err})") from None
        if only is not None and {r[0] for r in records} != only:
            raise CorruptEntry(f"lacks tensors {sorted(only - {r[0] for r in records})}")
        # Each tensor gets its own buffer (as in a fresh run, keeping one activation alive does not
        # keep the whole entry alive), read in file order.
        tensors: dict[str, Tensor] = {}
        read = start
        pos = start
        for name, dtype, shape, lo, hi in sorted(records, key=lambda r: r[3]):
            raw = torch.empty(hi - lo, dtype=torch.uint8)
            if hi > lo:
                if pos != start + lo:
                    f.seek(start + lo)
                if f.readinto(raw.numpy()) != hi - lo:
                    raise CorruptEntry("short read")
                pos = start + hi
            read += hi - lo
            if zlib.crc32(raw.numpy()) != crcs.get(name):
                raise CorruptEntry(f"checksum mismatch in tensor {name}")
            tensors[name] = raw.view(dtype).view(shape) if hi > lo else torch.empty(shape, dtype=dtype)
    return meta, tensors, read


__all__ = ["CorruptEntry", "FORMAT_VERSION", "STALE_AFTER_S", "read_entry", "read_meta", "sweep_stale_temps",
           "write_entry"]
