"""How a `CachedModel` call is keyed: what it computes, digested, and whether it can be cached at all.

A call's entry is named `<base>-<names>`: `base` digests everything but the activation names (entry
format, library versions and numerics settings, device placement, the model fingerprint, the
tokens, every other argument), `names` digests the request (`names_filter` resolved to names).
Entries with the same `base` are the index a subset request is served from (cache_select.py). A call
that cannot be keyed exactly (hooks attached, a training-mode model with dropout, an argument with
no exact description, ...) raises _Bypass with the reason, and runs uncached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import metadata as _md
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from . import cache_entry  # FORMAT_VERSION read at call time: a test stands in an older release by setting it
from .fingerprint import ModelState, inspect_model, tensor_bytes

if TYPE_CHECKING:
    from .cached import CachedModel


# arguments that do not change what is computed (handled on the way out, or irrelevant)
_UNKEYED = frozenset({"names_filter", "return_cache_object", "device", "reset_hooks_end", "clear_contexts",
                      "incl_bwd", "remove_batch_dim", "input"})


class _Bypass(Exception):
    """This call is not cacheable; the reason goes to the stats."""


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


@dataclass
class _Request:
    """The activations a call asks for: every one, a list of names (aliases allowed), or what a callable chose."""

    kind: Literal["all", "list", "callable"]
    names: tuple[str, ...]


def request_of(names_filter: Any, target: Any) -> _Request:
    """The activations a `names_filter` asks `target` (the model whose run_with_cache runs) for, as a key."""
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
            chosen = [n for n in target.hook_dict if names_filter(n)]
        except Exception:
            raise _Bypass("names_filter") from None
        return _Request("callable", tuple(sorted(set(chosen))))
    raise _Bypass("names_filter")


@dataclass
class _Plan:
    """A keyed call: where its entry lives, its digests, and the arguments reading it back needs."""

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
        return self.folder / f"{self.digest}{cache_entry._SUFFIX}"


def plan_call(cached: CachedModel, args: tuple, kwargs: dict[str, Any]) -> _Plan:
    """The key of a `run_with_cache(*args, **kwargs)` call on `cached`; _Bypass when it cannot be cached."""
    model = cached._target
    from .adapter import module_of
    from .backend import backend_name

    backend = backend_name(cached.model)
    if getattr(cached.model, "_edits", None):  # nnsight: edits replayed on every trace (model.edit())
        raise _Bypass("nnsight_edits")
    if kwargs.get("incl_bwd"):
        raise _Bypass("incl_bwd")
    if kwargs.get("remove_batch_dim"):
        raise _Bypass("remove_batch_dim")
    if len(args) > 1:
        raise _Bypass("positional_args")
    state = inspect_model(module_of(cached.model), full=cached.verify == "full")
    if state.active_hooks:
        raise _Bypass("hooks")
    if state.unhashable:
        raise _Bypass("unhashable_tensors")
    if state.stochastic:
        cached._warn_once("stochastic", "CachedModel: the model is in training mode with dropout: runs are "
                          "random, so they are not cached (call .eval())")
        raise _Bypass("training")
    if cached.grad == "bypass" and torch.is_grad_enabled() and state.requires_grad:
        raise _Bypass("grad")
    if "input" in kwargs and args:
        raise _Bypass("positional_args")
    inp = args[0] if args else kwargs.get("input")
    request = request_of(kwargs.get("names_filter"), model)
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
    doc = {"format": cache_entry.FORMAT_VERSION, "libs": _library_versions(), "numerics": _numerics(),
           "placement": _placement(state.devices), "backend": backend, "model": state.fingerprint,
           "input": inp_doc, "args": described}
    base = hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).hexdigest()
    names_doc = json.dumps([request.kind, list(request.names)])
    names = hashlib.blake2b(names_doc.encode(), digest_size=8).hexdigest()
    folder = cached.cache_folder
    assert folder is not None
    return _Plan(folder=folder, base=base, digest=f"{base}-{names}", request=request,
                 stop_at_layer=kwargs.get("stop_at_layer"), start_at_layer=kwargs.get("start_at_layer"),
                 return_cache_object=bool(kwargs.get("return_cache_object", True)),
                 device=kwargs.get("device"), state=state)
