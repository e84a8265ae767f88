"""Which activations a request selects, so a request can be served from an entry that holds more.

`_Selector` predicts, for a model, the keys a real `run_with_cache` returns for a request, in their
order, as TransformerLens 3 and 4 do it; `superset_entries` lists the entries of the same call (same
base digest, cache_key.py) that hold every name a request hooks, smallest first.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from .cache_entry import _SUFFIX, CorruptEntry, read_meta
from .cache_key import _Plan, _Request, _version


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


def superset_entries(plan: _Plan, hooked: set[str]) -> list[Path]:
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
