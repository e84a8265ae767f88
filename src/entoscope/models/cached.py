"""`CachedModel`: keeps what `run_with_cache` returned on disk, so a forward pass already made is read back.

    cached = CachedModel(model, cache_dir=".activation_cache")   # a TransformerBridge, HookedTransformer or nnsight model
    logits, cache = cached.run_with_cache(tokens, names_filter=[...])   # computed, written
    logits, cache = cached.run_with_cache(tokens, names_filter=[...])   # read back, bit for bit

Everything but `run_with_cache` is forwarded to the wrapped model (a method that returns the model
returns the wrapper). `cache_dir=None` passes every call straight through. See docs/cache.md.

An nnsight model has no `run_with_cache` of its own: the wrapper calls entoscope's (NNsightRunner,
over canonical site names: `resid_pre.0`, `z.1`), keys it on the HuggingFace module's weights, and
returns a plain dict of tensors.

The parts: cache_key.py (how a call is keyed, and which calls are not cached), cache_entry.py (the
entry file), cache_select.py (serving a subset request from a larger entry), cache_result.py
(storing a result and rebuilding it).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import ConfigError, UnsupportedModelError
from .cache_entry import (_SUFFIX, FORMAT_VERSION, STALE_AFTER_S, CorruptEntry, read_entry, read_meta,
                          sweep_stale_temps, write_entry)
from .cache_key import _Bypass, _Plan, _Request, _safe_name, plan_call
from .cache_result import _output_tids, materialize, pack_result
from .cache_select import _Selector, superset_entries

log = logging.getLogger("entoscope.cache")


class _Unservable(Exception):
    """An entry of the same call that cannot answer this subset request."""


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
            plan = plan_call(self, args, kwargs)
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
            superset_entries(plan, hooked)
        for cand in candidates:
            result = self._read(plan, cand, subset=(selector, hooked))
            if result is not None:
                with self._lock:
                    self._redirect[path] = cand
                return result
        return None

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
            result = materialize(plan, meta, tensors, served, self.model if self._target is self.model else None)
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
            arrays, meta = pack_result(plan, out, cache, self.dedupe_rows)
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


__all__ = ["CachedModel", "CorruptEntry", "FORMAT_VERSION", "STALE_AFTER_S", "read_entry", "read_meta",
           "sweep_stale_temps", "write_entry"]
