"""`model_fingerprint(model)`: one string that changes whenever anything that decides a model's outputs does.

Covered: the model class (and, for a TransformerBridge or a HuggingFace model itself, as under nnsight,
the HuggingFace class, its config and the attention implementation), the bridge's compatibility mode, every plain field of the TransformerLens
config (dimensions, dtype, normalisation, ...; not `device`, which the activation cache keys on
separately), and the name, kind, shape, dtype and every byte of every parameter and buffer.

Cost: each tensor is hashed once (SHA-256 over its raw bytes, a few tensors at a time on threads) and
re-hashed only when PyTorch reports it may have changed: its version counter moved (every in-place
op: `p.add_()`, `p[100, 5] = x` under no_grad, optimizer steps, `load_state_dict`, `nn.init`), or it
sits on another storage, offset, shape, stride, dtype or device (`p.data = new`, `.to()`, `.half()`,
a replaced Parameter). The memo holds a reference to each hashed storage, so a freed address cannot
be reused by a new tensor and mistaken for the old one.

`weights_stamp(model)` is the cheap half of that key (no bytes read): the one-time checks of a model
(models/guards.py) are redone only when it changes. A run's manifest records the fingerprint through
`deferred_fingerprint`, hashed when the manifest is first read or saved rather than during the run (on
GPT-2 small the hash is several times a short run), and only for the weights the run used.

The one blind spot is PyTorch's own: a write through `p.data` (`p.data[0, 0] = 1`, `p.data.add_()`)
or through a NumPy view bypasses the version counter, so nothing short of re-reading every byte can
see it. `model_fingerprint(model, full=True)` (and `CachedModel(..., verify="full")`) re-hashes every
tensor on every call; `forget(model)` drops the memo once.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

FINGERPRINT_VERSION = 1
_PLAIN = (bool, int, float, str, type(None))
_CFG_SKIP = frozenset({"device"})  # placement is keyed by the cache itself, not part of "which model"
_PARALLEL_BYTES = 32 << 20  # hash on threads only when this much needs hashing


@dataclass
class ModelState:
    """What one walk over the model found: its fingerprint and what a cache must know besides."""

    fingerprint: str
    devices: tuple[str, ...]             # distinct devices of parameters and buffers
    active_hooks: tuple[str, ...] = ()   # modules with hooks that are not the libraries' own
    stochastic: bool = False             # a dropout in training mode
    requires_grad: bool = False          # some parameter requires grad
    unhashable: tuple[str, ...] = ()     # tensors whose bytes could not be read (meta, ...)
    rehashed: int = 0                    # tensors hashed during this walk


@dataclass
class _Memo:
    tensors: dict[str, tuple[tuple, str, Any, Any]] = field(default_factory=dict)
    last_doc: tuple | None = None
    last_fp: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


_MEMOS: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_MEMOS_LOCK = threading.Lock()


def _unwrap(model: Any) -> Any:
    from .adapter import module_of

    return module_of(model)


def model_fingerprint(model: Any, *, full: bool = False) -> str:
    """Hex SHA-256 naming this model's exact computation (see the module docstring for what it covers).

    Accepts a TransformerBridge, a HookedTransformer, an nnsight model (its HuggingFace module is
    fingerprinted), a `CachedModel` or a `ModelAdapter`.
    `full=True` re-reads every tensor instead of trusting PyTorch's version counters.
    """
    return inspect_model(_unwrap(model), full=full).fingerprint


def forget(model: Any) -> None:
    """Drop the per-tensor hash memo of `model`: the next fingerprint re-reads every byte."""
    with _MEMOS_LOCK:
        _MEMOS.pop(_unwrap(model), None)


def _memo_for(model: Any) -> _Memo:
    with _MEMOS_LOCK:
        memo = _MEMOS.get(model)
        if memo is None:
            memo = _MEMOS[model] = _Memo()
        return memo


# ---------------------------------------------------------------------------------------------- walk
def _walk(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """named_modules without duplicates, as a plain iterative walk (cheaper than the recursive one)."""
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        yield prefix, mod
        children = mod.__dict__["_modules"]
        if children:
            dot = prefix + "." if prefix else ""
            stack.extend((dot + n, c) for n, c in reversed(children.items()) if c is not None)


# nnsight's hooks are inert outside a trace (its persistent edits are checked by CachedModel)
_LIBRARY_PREFIXES = ("transformers.", "transformer_lens.", "torch.", "accelerate.", "nnsight.")


def _hook_origin(fn: Any) -> str:
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return str(getattr(fn, "__module__", "") or "")


def _foreign_hooks(mod: torch.nn.Module, is_hook_point: bool) -> bool:
    """Hooks that may change what the module computes.

    Every hook on a TransformerLens HookPoint counts (that is how run_with_hooks, `model.hooks()`
    and add_hook intervene). Elsewhere, HuggingFace and TransformerLens install hooks of their own
    (output capturing, norm bookkeeping) on the first forward pass; those are recognised by the
    module that defines them, and any other hook counts.
    """
    dicts = [mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks,
             getattr(mod, "_backward_pre_hooks", {})]
    if is_hook_point:
        return any(len(d) for d in dicts)
    for d in dicts:
        for fn in d.values():
            if not _hook_origin(fn).startswith(_LIBRARY_PREFIXES):
                return True
    return False


def _stochastic(mod: torch.nn.Module) -> bool:
    if not mod.training:
        return False
    if isinstance(mod, torch.nn.modules.dropout._DropoutNd):
        return float(mod.p) > 0
    for attr in ("attention_dropout", "dropout", "attn_dropout_p"):
        v = mod.__dict__.get(attr)
        if isinstance(v, float) and v > 0:
            return True
    return False


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(i is _SKIP for i in items) else items
    if isinstance(value, dict):
        out = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in sorted(out.items()) if v is not _SKIP}
    return _SKIP


_SKIP = object()


def _config_doc(model: Any) -> dict[str, Any]:
    cfg = getattr(model, "cfg", None)
    fields = {}
    for k, v in sorted(vars(cfg).items() if cfg is not None else []):
        if k in _CFG_SKIP or k.startswith("__"):
            continue
        pv = _plain(v)
        if pv is not _SKIP:
            fields[k] = pv
    doc: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}", "cfg": fields}
    if hasattr(model, "compatibility_mode"):
        doc["compatibility_mode"] = bool(model.compatibility_mode)
    hf = getattr(model, "original_model", None)
    if hf is None and cfg is None and hasattr(model, "config"):  # a HuggingFace model itself (under nnsight)
        hf = model
    if hf is not None:
        doc["hf_class"] = f"{type(hf).__module__}.{type(hf).__qualname__}"
        hf_cfg = getattr(hf, "config", None)
        if hf_cfg is not None:
            try:
                doc["hf_config"] = hf_cfg.to_json_string(use_diff=False)
            except Exception:  # a config that does not serialise: fall back on its repr
                doc["hf_config"] = repr(hf_cfg)
            doc["attn_implementation"] = str(getattr(hf_cfg, "_attn_implementation", None))
    return doc


# ---------------------------------------------------------------------------------------- hashing
def _tensor_key(t: torch.Tensor) -> tuple:
    return (id(t), t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, t._version)


def weights_stamp(model: torch.nn.Module) -> tuple:
    """Which version of the weights `model` holds now: each parameter's and buffer's key as the fingerprint
    memo keys it (its object, storage, offset, shape, stride, dtype, device and version counter), so an
    in-place edit, a replaced tensor or a move gives another stamp. Costs microseconds per tensor: the
    one-time checks (guards.py) and the fingerprint are redone only when it changes."""
    keys = []
    for _, mod in _walk(model):
        d = mod.__dict__
        for store in (d["_parameters"], d["_buffers"]):
            if store:
                keys.extend(_tensor_key(t) for t in store.values() if t is not None)
    return tuple(keys)


def deferred_fingerprint(model: Any) -> Any:
    """A function of no arguments giving `model`'s fingerprint, hashed when it is first called (a run's
    manifest hashes the weights when it is written or read, not during the run: the hash reads every byte).
    It answers for the weights as they were when this was made: if they changed since (or the model was
    freed), it gives None rather than the fingerprint of other weights. Holds no reference to the model."""
    module = _unwrap(model)
    ref = weakref.ref(module)
    stamp = (weights_stamp(module), json.dumps(_config_doc(module), sort_keys=True))

    def fingerprint() -> str | None:
        now = ref()
        if now is None or (weights_stamp(now), json.dumps(_config_doc(now), sort_keys=True)) != stamp:
            return None
        return inspect_model(now).fingerprint
    return fingerprint


def tensor_bytes(t: torch.Tensor) -> Any:
    """The raw bytes of a tensor (row-major) as a NumPy uint8 array; copies only when it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


HASH_CHUNK = 16 * 2**20  # bytes of a tensor copied at once to be hashed (a transposed view is copied in row blocks)


def hash_into(h: Any, t: torch.Tensor) -> None:
    """Feed the raw bytes of `t` (row-major, as `tensor_bytes`) to the hash `h` in blocks of leading-axis rows, so
    a tensor that is not contiguous (a tied unembedding, W_E transposed: Gemma 3's is 640 MiB) is never copied
    whole; the digest is the same as hashing `tensor_bytes(t)` at once."""
    t = t.detach()
    if t.dim() < 2 or t.is_contiguous() or t.numel() * t.element_size() <= HASH_CHUNK:
        h.update(memoryview(tensor_bytes(t)))
        return
    step = max(1, HASH_CHUNK // max(1, t[0].numel() * t.element_size()))
    for lo in range(0, t.shape[0], step):
        h.update(memoryview(tensor_bytes(t[lo:lo + step])))


def _hash_tensor(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    hash_into(h, t)
    return h.hexdigest()


def inspect_model(model: Any, *, full: bool = False) -> ModelState:
    """Walk `model` once: fingerprint (re-hashing only what changed), devices, hooks, training state."""
    memo = _memo_for(model)
    devices: set[str] = set()
    hooks: list[str] = []
    stochastic = False
    requires_grad = False
    tensors: list[tuple[str, str, torch.Tensor]] = []  # (name, kind, tensor)
    seen_tensors: set[int] = set()
    try:
        from transformer_lens.hook_points import HookPoint
    except ImportError:  # pragma: no cover
        HookPoint = ()  # type: ignore[assignment,misc]
    for prefix, mod in _walk(model):
        d = mod.__dict__
        if (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d.get("_backward_pre_hooks")) and _foreign_hooks(mod, isinstance(mod, HookPoint)):
            hooks.append(prefix or "<root>")
        if d["training"] and not stochastic and _stochastic(mod):
            stochastic = True
        for kind, store in (("p", d["_parameters"]), ("b", d["_buffers"])):
            if not store:
                continue
            for n, t in store.items():
                if t is None or id(t) in seen_tensors:
                    continue
                seen_tensors.add(id(t))
                tensors.append((f"{prefix}.{n}" if prefix else n, kind, t))
                if kind == "p" and t.requires_grad:
                    requires_grad = True
    for mod_hooks in (torch.nn.modules.module._global_forward_hooks,
                      torch.nn.modules.module._global_forward_pre_hooks,
                      torch.nn.modules.module._global_backward_hooks):
        if any(not _hook_origin(fn).startswith(_LIBRARY_PREFIXES) for fn in mod_hooks.values()):
            hooks.append("<global>")

    with memo.lock:
        todo: list[tuple[str, torch.Tensor, tuple]] = []
        entries: list[tuple] = []
        unhashable: list[str] = []
        for name, kind, t in tensors:
            devices.add(str(t.device))
            if t.device.type == "meta":
                unhashable.append(name)
                continue
            key = _tensor_key(t)
            old = memo.tensors.get(name)
            if full or old is None or old[0] != key or old[2]() is not t:
                todo.append((name, t, key))
        if todo:
            total = sum(t.numel() * t.element_size() for _, t, _ in todo)
            if total >= _PARALLEL_BYTES and len(todo) > 1:
                workers = max(1, min(8, os.cpu_count() or 1))
                with ThreadPoolExecutor(workers) as pool:
                    digests = list(pool.map(lambda item: _hash_tensor(item[1]), todo))
            else:
                digests = [_hash_tensor(t) for _, t, _ in todo]
            for (name, t, key), digest in zip(todo, digests):
                # Keep the storage alive: its address cannot be handed to another tensor meanwhile.
                memo.tensors[name] = (key, digest, weakref.ref(t), t.untyped_storage())
        live = {name for name, _, _ in tensors}
        for name in [n for n in memo.tensors if n not in live]:
            del memo.tensors[name]
        for name, kind, t in tensors:
            if name in memo.tensors:
                entries.append((name, kind, str(t.dtype), tuple(t.shape), memo.tensors[name][1]))
        doc_key = (json.dumps(_config_doc(model), sort_keys=True), tuple(entries), tuple(unhashable))
        if doc_key != memo.last_doc:
            h = hashlib.sha256()
            h.update(f"entoscope-fingerprint-v{FINGERPRINT_VERSION}\n".encode())
            h.update(doc_key[0].encode())
            for e in entries:
                h.update(("\n" + "|".join(map(str, e))).encode())
            for n in unhashable:
                h.update(f"\nunhashable|{n}".encode())
            memo.last_doc, memo.last_fp = doc_key, h.hexdigest()
        fp = memo.last_fp
    return ModelState(fingerprint=fp, devices=tuple(sorted(devices)), active_hooks=tuple(hooks),
                      stochastic=stochastic, requires_grad=requires_grad, unhashable=tuple(unhashable),
                      rehashed=len(todo))



_WEIGHTS_MEMO: weakref.WeakKeyDictionary[Any, tuple[tuple, str | None]] = weakref.WeakKeyDictionary()
_PER_LAYER = ("W_Q", "b_Q", "W_K_kv", "W_V_kv", "b_K", "b_V", "W_O", "b_O", "W_in", "b_in", "W_gate", "W_out", "b_out")


def weights_fingerprint(model: Any) -> str | None:
    """Hex SHA-256 of a model's weights alone, read through entoscope's canonical view (models/weights.py):
    W_E, W_pos (learned positions), W_U, b_U and each layer's W_Q, W_K, W_V (per key/value head), W_O, W_in,
    W_gate, W_out and their biases, each tensor's name, dtype, shape and bytes. Unlike `model_fingerprint` it
    leaves out the class and the config, so one checkpoint read the same way gives one value as a plain bridge
    or through nnsight (their canonical weights are the same bytes), on any device; another dtype, or other
    processing (a compat bridge, a HookedTransformer: centred and folded weights), gives another. The norms'
    gains are left out (the backends present them differently). None when a weight cannot be read (on the
    meta device). Memoised per weights version (`weights_stamp`). The Jacobian lens records it and refuses
    a model whose weights differ from those it was fitted on (lens/jacobian.py)."""
    from .adapter import adapt

    a = adapt(model)
    module = a.module
    stamp = weights_stamp(module)
    hit = _WEIGHTS_MEMO.get(module)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    w, s = a.weights, a.structure
    named: list[tuple[str, Any]] = [("W_E", w.W_E), ("W_U", w.W_U), ("b_U", w.b_U)]
    if s.positional == "learned":
        named.append(("W_pos", w.W_pos))
    h = hashlib.sha256(f"entoscope-weights-v{FINGERPRINT_VERSION}\n".encode())
    digest: str | None = None
    with torch.no_grad():
        for layer in range(s.n_layers):
            named += [(f"{n}.{layer}", getattr(w, n)(layer)) for n in _PER_LAYER]
            for name, t in named:
                if t is None:
                    continue
                if t.device.type == "meta":
                    break
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                hash_into(h, t)
            else:
                named = []
                continue
            break
        else:
            digest = h.hexdigest()
    _WEIGHTS_MEMO[module] = (stamp, digest)
    return digest
