"""What a cached call returns, and how it is stored: (output, activation cache) to entry tensors and back.

`pack_result` turns a `run_with_cache` result into the tensors and metadata of an entry (the output
as a tree of tensors, each cache key pointing at a stored tensor, shared tensors stored once, alike
rows stored once); `materialize` rebuilds the result from an entry read back, on the devices a
fresh run would put it on, aliases sharing one tensor as in a fresh run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import cache_entry  # FORMAT_VERSION read at call time: a test stands in an older release by setting it
from .cache_entry import _ST_DTYPES, CorruptEntry
from .cache_key import _Bypass, _Plan


def _output_tids(node: Any) -> set[str]:
    """The ids of the stored tensors an entry's output tree points at."""
    if node[0] == "tensor":
        return {node[1]}
    if node[0] == "tuple":
        return set().union(*(_output_tids(n) for n in node[1])) if node[1] else set()
    return set()


def _rows_alike(c: Tensor) -> bool:
    """True when every row (dim 0) of the contiguous CPU tensor `c` equals row 0 bit for bit."""
    if c.dim() == 0 or c.shape[0] < 2 or c.numel() == 0:
        return False
    b = c.reshape(c.shape[0], -1).view(torch.uint8)
    return torch.equal(b[1:], b[:1].expand(b.shape[0] - 1, b.shape[1]))


def materialize(plan: _Plan, meta: dict[str, Any], tensors: dict[str, Tensor], served: list[str] | None,
                cache_model: Any) -> Any:
    """What the call `plan` returns, rebuilt from an entry's metadata and tensors: (output, cache).

    `served`: the cache keys to return, in order (a subset answer), None for all the entry holds.
    `cache_model`: the model the cache is an ActivationCache of (when the call asks for one); None
    for a plain dict (an nnsight model). None (recompute) where an activation's device is not known:
    no `device` asked for, the entry written with one, and the model over several devices.
    """
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
    if plan.return_cache_object and cache_model is not None:
        from transformer_lens import ActivationCache

        return out, ActivationCache(cache, cache_model, has_batch_dim=True)
    return out, cache


def pack_result(plan: _Plan, out: Any, cache: Any, dedupe_rows: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, metadata) of the entry that stores what the call `plan` returned: `out` and `cache`.

    A tensor the output and the cache share (or two cache keys share) is stored once; with
    `dedupe_rows`, a tensor whose batch rows are alike bit for bit is stored as one row. _Bypass
    for a result that cannot be stored exactly.
    """
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
        if dedupe_rows and _rows_alike(c):
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
    meta = {"format": cache_entry.FORMAT_VERSION, "digest": plan.digest, "base": plan.base,
            "request": [plan.request.kind, list(plan.request.names)], "output": out_node, "keys": keys,
            "tensors": records, "natural_devices": plan.device is None,
            "model": plan.state.fingerprint}
    return arrays, meta
