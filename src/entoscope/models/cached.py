"""`CachedModel`: keeps what `run_with_cache` returned on disk, so a forward pass already made is read back.

    cached = CachedModel(model, cache_dir=".activation_cache")   # a TransformerBridge, HookedTransformer or nnsight model
    logits, cache = cached.run_with_cache(tokens, names_filter=[...])   # computed, written
    logits, cache = cached.run_with_cache(tokens, names_filter=[...])   # read back, bit for bit

Everything but `run_with_cache` is forwarded to the wrapped model (a method that returns the model
returns the wrapper). `cache_dir=None` passes every call straight through. See docs/cache.md.

An nnsight model has no `run_with_cache` of its own: the wrapper calls entoscope's (NNsightRunner,
over canonical site names: `resid_pre.0`, `z.1`), keys it on the HuggingFace module's weights, and
returns a plain dict of tensors.

An entry is `<cache_dir>/<model folder>/<base>-<names>.safetensors`: `base` digests everything but
the activation names (entry format, library versions and numerics settings, device placement, the
model fingerprint, the tokens, every other argument), `names` digests the request. Entries with the
same `base` are the index a subset request is served from. Each file is a valid safetensors file
whose metadata says what it holds and carries a CRC-32 of its tensor bytes; nothing in it executes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as _md
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import ConfigError, UnsupportedModelError
from .fingerprint import ModelState, inspect_model, tensor_bytes

log = logging.getLogger("entoscope.cache")

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
# arguments that do not change what is computed (handled on the way out, or irrelevant)
_UNKEYED = frozenset({"names_filter", "return_cache_object", "device", "reset_hooks_end", "clear_contexts",
                      "incl_bwd", "remove_batch_dim", "input"})


class _Bypass(Exception):
    """This call is not cacheable; the reason goes to the stats."""


class _Unservable(Exception):
    """An entry of the same call that cannot answer this subset request."""


def _output_tids(node: Any) -> set[str]:
    if node[0] == "tensor":
        return {node[1]}
    if node[0] == "tuple":
        return set().union(*(_output_tids(n) for n in node[1])) if node[1] else set()
    return set()


class CorruptEntry(Exception):
    """An entry file that cannot be trusted (truncated, garbage, other format, wrong digest)."""


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=1)
def _library_versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": _version("transformers"),
            "transformer_lens": _version("transformer-lens")}


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    try:
        return torch.cuda.get_device_name(index)
    except Exception:  # pragma: no cover - no CUDA
        return "unknown"


def _numerics() -> dict[str, Any]:
    """Global settings that change the bits a forward pass produces."""
    cuda = torch.backends.cuda.matmul
    return {"f32_matmul": torch.get_float32_matmul_precision(), "tf32": bool(cuda.allow_tf32),
            "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
            "fp16_reduced": bool(getattr(cuda, "allow_fp16_reduced_precision_reduction", False)),
            "bf16_reduced": bool(getattr(cuda, "allow_bf16_reduced_precision_reduction", False)),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def _placement(devices: tuple[str, ...]) -> list[str]:
    out = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda":
            out.append(f"{d}={_cuda_name(dev.index or 0)}")
        else:
            out.append(d)
    return out


def _safe_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-") or "model"
    if len(safe) > 80:
        safe = safe[:60] + "_" + hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
    return safe


def _hash_tensor_small(t: Tensor) -> dict[str, Any]:
    h = hashlib.blake2b(memoryview(tensor_bytes(t)), digest_size=16)
    return {"tensor": str(t.dtype), "shape": list(t.shape), "blake2b": h.hexdigest()}


def _describe(value: Any) -> Any:
    """A JSON description of an argument that identifies its value exactly; _Bypass if there is none."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return [type(value).__name__, value]
    if isinstance(value, Tensor):
        return _hash_tensor_small(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return [type(value).__name__, str(value)]
    if isinstance(value, slice):
        return ["slice", _describe(value.start), _describe(value.stop), _describe(value.step)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_describe(v) for v in value]]
    raise _Bypass("argument")


# ------------------------------------------------------------------------------------------ entries
def _rows_alike(c: Tensor) -> bool:
    """True when every row (dim 0) of the contiguous CPU tensor `c` equals row 0 bit for bit."""
    if c.dim() == 0 or c.shape[0] < 2 or c.numel() == 0:
        return False
    b = c.reshape(c.shape[0], -1).view(torch.uint8)
    return torch.equal(b[1:], b[:1].expand(b.shape[0] - 1, b.shape[1]))


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


# ------------------------------------------------------------------------------------------ the plan
@dataclass
class _Request:
    kind: Literal["all", "list", "callable"]
    names: tuple[str, ...]


@dataclass
class _Plan:
    folder: Path
    base: str
    digest: str
    request: _Request
    stop_at_layer: Any
    start_at_layer: Any
    return_cache_object: bool
    device: Any
    state: ModelState

    @property
    def path(self) -> Path:
        return self.folder / f"{self.digest}{_SUFFIX}"


@functools.lru_cache(maxsize=1)
def _tl_major() -> int:
    try:
        return int(_version("transformer-lens").split(".")[0])
    except ValueError:  # pragma: no cover
        return 0


class _Selector:
    """Which keys a real `run_with_cache` returns for a request, in order, as TransformerLens 3 and 4 do it.

    A HookedTransformer caches the hook names the filter accepts, in the order their hooks fire. A
    TransformerBridge adds, for a list or a string, the canonical name of each alias asked for; skips
    gated hooks; skips blocks from `stop_at_layer` on; and in compatibility mode adds every alias of
    a cached name afterwards. Every real call is checked against this (CachedModel._check_selection):
    one disagreement turns subset answers off for that wrapper.
    """

    def __init__(self, model: Any, stop_at_layer: Any) -> None:
        from .backend import backend_name

        self.model = model
        self.names = list(model.hook_dict.items())
        self.bridge = backend_name(model) == "bridge"
        self.compat = self.bridge and bool(getattr(model, "compatibility_mode", False))
        self.aliases = {k: hp.name for k, hp in self.names
                        if isinstance(getattr(hp, "name", None), str) and k != hp.name} if self.bridge else {}
        self.stop = None
        if self.bridge and isinstance(stop_at_layer, int):
            self.stop = stop_at_layer + len(model.blocks) if stop_at_layer < 0 else stop_at_layer

    def _gated(self, name: str, hp: Any) -> bool:
        reason = getattr(self.model, "_gated_hook_reason", None)
        if reason is None:
            return False
        # TransformerLens 4 asks about the hook point's own name, 3 about the name as requested.
        return reason((getattr(hp, "name", None) or name) if _tl_major() >= 4 else name) is not None

    def hooked(self, request: _Request, *, strict: bool = False) -> set[str] | None:
        """The hook names a real call attaches its caching hooks to; None where a real call would
        refuse the request (a name that matches nothing, one the backend cannot fire) or, when
        `strict` (for a request to answer), warn about it (a gated-off hook: the real call says so)."""
        if request.kind == "all":
            chosen = {n for n, _ in self.names}
        else:
            chosen = set(request.names)
            if request.kind == "list":
                chosen |= {self.aliases[n] for n in request.names if n in self.aliases}
                check = getattr(self.model, "_check_hook_fireable", None)
                if check is not None:
                    try:
                        for n in request.names:
                            check(n, self.aliases.get(n, n))
                    except Exception:
                        return None
        matched = [(n, hp) for n, hp in self.names if n in chosen]
        if not matched and request.kind != "all":
            return None
        if not self.bridge:
            return {n for n, _ in matched}
        out = set()
        for n, hp in matched:
            if self.stop is not None and n.startswith("blocks."):
                parts = n.split(".")
                if len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= self.stop:
                    continue
            if request.kind != "all" and self._gated(n, hp):
                if strict:
                    return None
                continue
            out.add(n)
        return out

    def closure(self, fired: list[str]) -> list[str]:
        """The keys of a real call whose hooks fired in this order (compatibility mode adds aliases)."""
        keys = list(fired)
        if not self.compat:
            return keys
        present = set(keys)
        reverse = {canonical: alias for alias, canonical in self.aliases.items()}
        for k in fired:
            alias = reverse.get(k)
            if alias is not None and alias not in present:
                keys.append(alias)
                present.add(alias)
        for alias, canonical in self.aliases.items():
            if alias not in present and canonical in present:
                keys.append(alias)
                present.add(alias)
        return keys

    def serve(self, hooked: set[str], stored: list[str], request: _Request) -> list[str] | None:
        """The keys, in order, of a real call that hooks `hooked`, read from an entry that holds
        `stored` for `request`; None when that entry cannot tell (a name that did not fire there)."""
        hooked_there = self.hooked(request)
        if hooked_there is None:
            return None
        fired_there = [k for k in stored if k in hooked_there]
        if not hooked <= set(fired_there):
            return None
        keys = self.closure([k for k in fired_there if k in hooked])
        return keys if set(keys) <= set(stored) else None


class CachedModel:
    """A TransformerBridge or HookedTransformer whose `run_with_cache` results are kept on disk.

    model:     the model to wrap (TransformerBridge, plain or compat; or HookedTransformer).
    cache_dir: the cache folder (created on first write); None turns caching off: every call goes
               straight to the model and nothing touches the disk.
    verify:    "version" (default): a tensor is re-hashed when PyTorch's version counter, storage,
               shape, stride, dtype or device says it may have changed. "full": every tensor is
               re-hashed on every call (also catches writes through `param.data`, at the cost of
               reading every weight each call).
    dedupe_rows: store a tensor whose batch rows are alike bit for bit as one row (read back at
               full width). Off only to measure what it saves.
    grad:      "detach" (default): a call is cached whatever the grad mode, and returns detached
               tensors (requires_grad False) on a miss as on a hit, so what a call returns never
               depends on the cache's state. Gradient passes go through run_with_hooks, which is never
               cached. "bypass": a call made with gradients enabled on a model with parameters that
               require grad runs uncached and returns the live autograd graph (the old behaviour).
    """

    _entoscope_wrapper = True
    _OWN = frozenset({"model", "cache_dir", "verify", "dedupe_rows", "grad", "_lock", "_stats", "_bypass",
                      "_subset_ok", "_redirect", "_warned", "_swept", "_target"})

    def __init__(self, model: Any, cache_dir: str | os.PathLike[str] | None = ".activation_cache", *,
                 verify: Literal["version", "full"] = "version", dedupe_rows: bool = True,
                 grad: Literal["detach", "bypass"] = "detach") -> None:
        if isinstance(model, CachedModel):
            raise UnsupportedModelError("this model is already a CachedModel",
                                        remedy="wrap the model itself: CachedModel(cached.model, ...)",
                                        code="already_cached")
        from .backend import backend_for

        runner = backend_for(model).runner  # refuses anything but a TransformerBridge, HookedTransformer, nnsight model
        if verify not in ("version", "full"):
            raise ConfigError(f"unknown verify mode {verify!r}", remedy="use 'version' or 'full'",
                              code="unknown_verify_mode")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "cache_dir", None if cache_dir is None else Path(cache_dir).expanduser().absolute())
        object.__setattr__(self, "verify", verify)
        object.__setattr__(self, "dedupe_rows", bool(dedupe_rows))
        if grad not in ("detach", "bypass"):
            raise ConfigError(f"unknown grad mode {grad!r}", remedy="use 'detach' or 'bypass'", code="unknown_grad_mode")
        object.__setattr__(self, "grad", grad)
        object.__setattr__(self, "_target", runner)
        self._init_state()

    def _init_state(self) -> None:
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_stats", Counter())
        object.__setattr__(self, "_bypass", Counter())
        object.__setattr__(self, "_subset_ok", True)
        object.__setattr__(self, "_redirect", {})
        object.__setattr__(self, "_warned", set())
        object.__setattr__(self, "_swept", False)

    # ------------------------------------------------------------------ forwarding
    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        attr = getattr(model, name)
        if callable(attr) and getattr(attr, "__self__", None) is model and not isinstance(attr, torch.nn.Module):
            @functools.wraps(attr)
            def call(*args: Any, **kwargs: Any) -> Any:
                result = attr(*args, **kwargs)
                return self if result is model else result
            return call
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.model, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.model)))

    def __repr__(self) -> str:
        return f"CachedModel({type(self.model).__name__}, cache_dir={str(self.cache_dir) if self.cache_dir else None!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "cache_dir": self.cache_dir, "verify": self.verify,
                "dedupe_rows": self.dedupe_rows, "grad": self.grad}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {"grad": "detach", **state}
        for k, v in state.items():
            object.__setattr__(self, k, v)
        from .backend import backend_for

        object.__setattr__(self, "_target", backend_for(self.model).runner)
        self._init_state()

    # ------------------------------------------------------------------ stats
    def cache_stats(self) -> dict[str, Any]:
        """Counts for this wrapper: hits (exact), subset_hits, misses, bypassed (and why), corrupt
        entries found, write errors, bytes read and written; and the entries and bytes on disk
        under this model's folder."""
        with self._lock:
            s = dict(self._stats)
            reasons = dict(self._bypass)
        out: dict[str, Any] = {k: s.get(k, 0) for k in ("hits", "subset_hits", "misses", "bypassed", "corrupt",
                                                        "write_errors", "unstorable", "bytes_read",
                                                        "bytes_written")}
        out["bypass_reasons"] = reasons
        folder = self.cache_folder
        entries = disk = 0
        if folder is not None and folder.is_dir():
            for e in os.scandir(folder):
                if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                    try:
                        size = e.stat().st_size
                    except FileNotFoundError:  # removed by another process since the listing
                        continue
                    entries += 1
                    disk += size
        out["entries"], out["disk_bytes"] = entries, disk
        if folder is not None:
            removed, live = sweep_stale_temps(folder)
            self._count("stale_temps_removed", removed)
            out["temp_files"] = live
        else:
            out["temp_files"] = 0
        out["stale_temps_removed"] = self._stats.get("stale_temps_removed", 0)
        return out

    @property
    def cache_folder(self) -> Path | None:
        """Where this model's entries live (None when caching is off)."""
        if self.cache_dir is None:
            return None
        from .backend import backend_name

        name = str(getattr(self._target.cfg, "model_name", None) or "model")
        return self.cache_dir / f"{_safe_name(name)}__{backend_name(self.model)}"

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _warn_once(self, reason: str, message: str) -> None:
        with self._lock:
            if reason in self._warned:
                return
            self._warned.add(reason)
        log.warning(message)

    # ------------------------------------------------------------------ the cached call
    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's `run_with_cache`, read from disk when this exact call was made before."""
        if self.cache_dir is None:
            return self._target.run_with_cache(*args, **kwargs)
        try:
            plan = self._plan(args, kwargs)
        except Exception as why:
            reason = str(why) if isinstance(why, _Bypass) else "error"
            if reason == "error":
                self._warn_once(f"plan:{type(why).__name__}", f"CachedModel: cannot key this call "
                                f"({type(why).__name__}: {why}); running it uncached")
            with self._lock:
                self._stats["bypassed"] += 1
                self._bypass[reason] += 1
            return self._target.run_with_cache(*args, **kwargs)
        try:
            hit = self._lookup(plan)
        except Exception as err:  # the cache must never break a run: recompute
            log.warning("CachedModel: cache lookup failed (%s: %s); recomputing", type(err).__name__, err)
            hit = None
        if hit is not None:
            return hit
        self._count("misses")
        with torch.no_grad():  # what is returned is detached, as on a hit: no graph is built for nothing
            out, cache = self._target.run_with_cache(*args, **kwargs)
        self._store(plan, out, cache)
        return out, cache

    def _plan(self, args: tuple, kwargs: dict[str, Any]) -> _Plan:
        model = self._target
        from .adapter import module_of
        from .backend import backend_name

        backend = backend_name(self.model)
        if getattr(self.model, "_edits", None):  # nnsight: edits replayed on every trace (model.edit())
            raise _Bypass("nnsight_edits")
        if kwargs.get("incl_bwd"):
            raise _Bypass("incl_bwd")
        if kwargs.get("remove_batch_dim"):
            raise _Bypass("remove_batch_dim")
        if len(args) > 1:
            raise _Bypass("positional_args")
        state = inspect_model(module_of(self.model), full=self.verify == "full")
        if state.active_hooks:
            raise _Bypass("hooks")
        if state.unhashable:
            raise _Bypass("unhashable_tensors")
        if state.stochastic:
            self._warn_once("stochastic", "CachedModel: the model is in training mode with dropout: runs are "
                            "random, so they are not cached (call .eval())")
            raise _Bypass("training")
        if self.grad == "bypass" and torch.is_grad_enabled() and state.requires_grad:
            raise _Bypass("grad")
        if "input" in kwargs and args:
            raise _Bypass("positional_args")
        inp = args[0] if args else kwargs.get("input")
        request = self._request(kwargs.get("names_filter"))
        described: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k in _UNKEYED or (k == "return_type" and v == "logits"):
                continue
            described[k] = _describe(v)
        if isinstance(inp, str) or (isinstance(inp, list) and inp and all(isinstance(s, str) for s in inp)):
            tok_kw = {k: kwargs[k] for k in ("prepend_bos", "padding_side") if k in kwargs}
            try:
                tokens = model.to_tokens(inp, **tok_kw)
            except Exception:
                raise _Bypass("tokenize") from None
            inp_doc: Any = {"text": _describe(inp), "tokens": _hash_tensor_small(tokens)}
        elif isinstance(inp, Tensor):
            inp_doc = _hash_tensor_small(inp)
        else:
            raise _Bypass("input")
        doc = {"format": FORMAT_VERSION, "libs": _library_versions(), "numerics": _numerics(),
               "placement": _placement(state.devices), "backend": backend, "model": state.fingerprint,
               "input": inp_doc, "args": described}
        base = hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).hexdigest()
        names_doc = json.dumps([request.kind, list(request.names)])
        names = hashlib.blake2b(names_doc.encode(), digest_size=8).hexdigest()
        folder = self.cache_folder
        assert folder is not None
        return _Plan(folder=folder, base=base, digest=f"{base}-{names}", request=request,
                     stop_at_layer=kwargs.get("stop_at_layer"), start_at_layer=kwargs.get("start_at_layer"),
                     return_cache_object=bool(kwargs.get("return_cache_object", True)),
                     device=kwargs.get("device"), state=state)

    def _request(self, names_filter: Any) -> _Request:
        if names_filter is None:
            return _Request("all", ())
        if isinstance(names_filter, str):
            return _Request("list", (names_filter,))
        if isinstance(names_filter, list):
            if not all(isinstance(n, str) for n in names_filter):
                raise _Bypass("names_filter")
            return _Request("list", tuple(sorted(set(names_filter))))
        if callable(names_filter):
            # A callable cannot be hashed; what it selects can. TransformerLens applies it to every
            # hook name (no alias mapping), so the key is the resolved names under their own kind.
            try:
                chosen = [n for n in self._target.hook_dict if names_filter(n)]
            except Exception:
                raise _Bypass("names_filter") from None
            return _Request("callable", tuple(sorted(set(chosen))))
        raise _Bypass("names_filter")

    # ------------------------------------------------------------------ reading
    def _lookup(self, plan: _Plan) -> Any:
        path = plan.path
        if path.exists():
            return self._read(plan, path)
        if plan.request.kind == "all" or not self._subset_ok or plan.start_at_layer is not None:
            return None
        selector = _Selector(self._target, plan.stop_at_layer)
        hooked = selector.hooked(plan.request, strict=True)
        if not hooked:
            return None
        redirect = self._redirect.get(path)
        candidates = [redirect] if redirect is not None and redirect.exists() else \
            self._supersets(plan, hooked)
        for cand in candidates:
            result = self._read(plan, cand, subset=(selector, hooked))
            if result is not None:
                with self._lock:
                    self._redirect[path] = cand
                return result
        return None

    def _supersets(self, plan: _Plan, hooked: set[str]) -> list[Path]:
        """Entries of the same call (same base digest) that hold every name this request hooks."""
        if not plan.folder.is_dir():
            return []
        found: list[tuple[int, str, Path]] = []
        prefix = plan.base + "-"
        for e in os.scandir(plan.folder):
            if not (e.name.startswith(prefix) and e.name.endswith(_SUFFIX)):
                continue
            try:
                meta = read_meta(Path(e.path))
            except (OSError, CorruptEntry):
                continue
            keys = {k for k, _ in meta.get("keys", [])}
            if meta.get("base") == plan.base and hooked <= keys:
                found.append((int(meta.get("data_bytes", 0)), e.name, Path(e.path)))
        return [p for _, _, p in sorted(found)]

    def _read(self, plan: _Plan, path: Path, subset: tuple[_Selector, set[str]] | None = None) -> Any:
        digest = path.name[: -len(_SUFFIX)]
        served: list[str] | None = None

        def select(meta: dict[str, Any]) -> set[str] | None:
            nonlocal served
            if subset is None:
                if meta.get("request") != [plan.request.kind, list(plan.request.names)]:
                    raise CorruptEntry("holds another request")
                return None
            selector, hooked = subset
            kind, names = meta["request"]
            served = selector.serve(hooked, [k for k, _ in meta["keys"]], _Request(kind, tuple(names)))
            if served is None:
                raise _Unservable
            stored = dict((k, tid) for k, tid in meta["keys"])
            return {stored[k] for k in served if stored[k] is not None} | _output_tids(meta["output"])

        try:
            meta, tensors, size = read_entry(path, digest, select)
            result = self._materialize(plan, meta, tensors, served)
        except _Unservable:
            return None
        except FileNotFoundError:
            return None
        except Exception as err:
            self._count("corrupt")
            log.warning("CachedModel: ignoring unusable cache entry %s (%s: %s); recomputing", path,
                        type(err).__name__, err)
            if subset is not None:  # a damaged superset would be picked again; the exact one is overwritten
                try:
                    os.unlink(path)
                except OSError:
                    pass
            return None
        if result is None:
            return None
        with self._lock:
            self._stats["hits" if subset is None else "subset_hits"] += 1
            self._stats["bytes_read"] += size
        return result

    def _materialize(self, plan: _Plan, meta: dict[str, Any], tensors: dict[str, Tensor],
                     served: list[str] | None) -> Any:
        records: dict[str, dict[str, Any]] = meta["tensors"]
        natural = bool(meta.get("natural_devices", True))
        model_devices = plan.state.devices
        built: dict[tuple[str, str], Tensor] = {}
        full: dict[str, Tensor] = {}

        def get(tid: str, is_output: bool) -> Tensor | None:
            rec = records[tid]
            if is_output or (plan.device is None and natural):
                target: Any = rec["device"]
            elif plan.device is not None:
                target = plan.device
            elif len(model_devices) == 1:
                target = model_devices[0]
            else:
                return None  # placement over several devices unknown: recompute
            if (tid, str(target)) in built:  # aliases share one tensor, as in a fresh run
                return built[tid, str(target)]
            if tid not in full:
                t = tensors[tid]
                if rec.get("rows") is not None:
                    t = t.expand(int(rec["rows"]), *t.shape[1:]).contiguous()
                if list(t.shape) != rec["shape"] or str(t.dtype) != rec["dtype"]:
                    raise CorruptEntry(f"tensor {tid} reads back as {list(t.shape)} {t.dtype}, "
                                       f"recorded {rec['shape']} {rec['dtype']}")
                full[tid] = t
            t = full[tid].to(target)
            built[tid, str(target)] = t
            return t

        def output(node: Any) -> Any:
            kind = node[0]
            if kind == "none":
                return None
            if kind == "tensor":
                t = get(node[1], True)
                if t is None:
                    raise CorruptEntry("output tensor")
                return t
            if kind == "tuple":
                return tuple(output(n) for n in node[1])
            raise CorruptEntry(f"unknown output node {kind!r}")

        out = output(meta["output"])
        cache: dict[str, Tensor | None] = {}
        stored = {key: tid for key, tid in meta["keys"]}
        for key in served if served is not None else stored:
            tid = stored[key]
            if tid is None:
                cache[key] = None
                continue
            t = get(tid, False)
            if t is None:
                return None
            cache[key] = t
        if plan.return_cache_object and self._target is self.model:
            from transformer_lens import ActivationCache

            return out, ActivationCache(cache, self.model, has_batch_dim=True)
        return out, cache

    # ------------------------------------------------------------------ subsets
    def _check_selection(self, plan: _Plan, keys: list[str]) -> None:
        """After each real call: the selection model must predict exactly the keys (and order) it
        returned; if it ever does not, subsets are no longer served from larger entries."""
        if not self._subset_ok:
            return
        try:
            selector = _Selector(self._target, plan.stop_at_layer)
            hooked = selector.hooked(plan.request)
            # (nothing to compare where the selector leaves the call to TransformerLens: hooked None)
            ok = plan.start_at_layer is not None or hooked is None or \
                selector.closure([k for k in keys if k in hooked]) == keys
        except Exception:
            ok = False
        if not ok:
            object.__setattr__(self, "_subset_ok", False)
            log.warning("CachedModel: this TransformerLens returns activation names other than expected "
                        "for %s; subsets are no longer served from larger entries", plan.request.kind)

    # ------------------------------------------------------------------ writing
    def _store(self, plan: _Plan, out: Any, cache: Any) -> None:
        """Write the entry; a failure is logged and counted, never raised (the caller has its result)."""
        if not self._swept:
            object.__setattr__(self, "_swept", True)
            try:
                self._count("stale_temps_removed", sweep_stale_temps(plan.folder)[0])
            except OSError:
                pass
        try:
            arrays, meta = self._pack(plan, out, cache)
            self._check_selection(plan, [k for k, _ in meta["keys"]])
            n = write_entry(plan.path, arrays, meta)
        except _Bypass as why:
            self._count("unstorable")
            log.debug("CachedModel: result not stored (%s)", why)
            return
        except Exception as err:
            self._count("write_errors")
            log.warning("CachedModel: could not write cache entry %s (%s: %s); continuing", plan.path,
                        type(err).__name__, err)
            return
        self._count("bytes_written", n)

    def _pack(self, plan: _Plan, out: Any, cache: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
        cache_dict = getattr(cache, "cache_dict", cache)
        if not isinstance(cache_dict, dict):
            raise _Bypass("cache type")
        arrays: dict[str, Tensor] = {}
        records: dict[str, dict[str, Any]] = {}
        groups: dict[tuple, str] = {}

        def add(t: Tensor, prefix: str) -> str:
            if t.dtype not in _ST_DTYPES or t.is_sparse or t.device.type == "meta":
                raise _Bypass(f"tensor {t.dtype} {t.layout}")
            ident = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device))
            if ident in groups:
                return groups[ident]
            tid = f"{prefix}{len(records)}"
            groups[ident] = tid
            c = t.detach().to("cpu").contiguous()
            rows = None
            if self.dedupe_rows and _rows_alike(c):
                rows, c = int(c.shape[0]), c[:1]
            arrays[tid] = c
            records[tid] = {"shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device), "rows": rows}
            return tid

        def node(o: Any) -> Any:
            if o is None:
                return ["none"]
            if isinstance(o, Tensor):
                return ["tensor", add(o, "o")]
            if type(o) is tuple:
                return ["tuple", [node(x) for x in o]]
            raise _Bypass(f"output {type(o).__name__}")

        out_node = node(out)
        keys: list[list[Any]] = []
        for k, v in cache_dict.items():
            if v is None:
                keys.append([k, None])
            elif isinstance(v, Tensor):
                keys.append([k, add(v, "a")])
            else:
                raise _Bypass(f"cache value {type(v).__name__}")
        meta = {"format": FORMAT_VERSION, "digest": plan.digest, "base": plan.base,
                "request": [plan.request.kind, list(plan.request.names)], "output": out_node, "keys": keys,
                "tensors": records, "natural_devices": plan.device is None,
                "model": plan.state.fingerprint}
        return arrays, meta


__all__ = ["CachedModel", "CorruptEntry", "FORMAT_VERSION", "read_entry", "read_meta", "write_entry"]
