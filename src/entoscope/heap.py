"""Giving freed memory back to the system between the steps of a long job (the report's sections, the entries
of `entoscope run`).

glibc's allocator keeps the heap pages of freed tensors and Python objects mapped, so a process that ran a
memory-hungry step stays that large, and the next step's peak sits on top of it (SmolLM2's report: 1.40 GiB
resident after the patching section against 1.10 GiB after `malloc_trim`; benchmarks/bench_report_real.py).
`malloc_trim(0)` returns them. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import gc
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library this process runs on (its own symbols: no library search), where it has malloc_trim."""
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") else None


def give_back_memory() -> None:
    """Collect garbage, then return the allocator's free pages to the system (glibc only)."""
    gc.collect()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
