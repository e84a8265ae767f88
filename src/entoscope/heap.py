"""Giving freed memory back to the system between the steps of a long job (the report's sections, the entries
of `entoscope run`).

glibc's allocator keeps the heap pages of freed tensors and Python objects mapped, so a process that ran a
memory-hungry step stays that large, and the next step's peak sits on top of it (SmolLM2's report: 1.40 GiB
resident after the patching section against 1.10 GiB after `malloc_trim`; benchmarks/bench_report_real.py).
`malloc_trim(0)` returns them. Elsewhere (macOS, musl) it does nothing.

`steady_heap()` (called once per process when an operation is first prepared) fixes glibc's mmap threshold at
MMAP_THRESHOLD: by default glibc raises the threshold to the size of each large block freed (up to 32 MiB) and
the trim threshold with it, so a loop of vocabulary-sized tensors ends up on the heap, between small live objects,
and the heap grows past what is live (SmolLM2's logit lens over 30 layers x 20 positions, 16 prompts: 2,290 MiB
resident above the model with the default, 389 MiB with the threshold fixed at 1 MiB; benchmarks/bench_memory.py;
a loop of 7.5 MiB tensors beside small kept ones grows by ~20 MiB an iteration with the threshold at 16 MiB, and
not at all at 1 MiB). With it fixed (and the trim threshold put back at glibc's 128 KiB), a freed block of 1 MiB
or more goes back to the system at once and the heap is trimmed as it shrinks,
so a run's resident peak follows its live tensors and a memory budget (memory.py) can hold. The price is the
page faults of fresh blocks: ~10% more CPU time in a loop of vocabulary-sized elementwise work (log-softmax,
top-k), less in a loop of matrix products. Setting the
environment variable ENTOSCOPE_MALLOC=system leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from contextlib import contextmanager
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 2**20
TRIM_THRESHOLD = 128 * 2**10  # glibc's own default, which its dynamic adjustment may have raised by now
_steady = False


def steady_heap() -> bool:
    """Fix glibc's mmap threshold (module docstring), once per process; False where it is not done (not glibc,
    or ENTOSCOPE_MALLOC=system)."""
    import os

    global _steady
    if _steady:
        return True
    lib = _libc()
    if lib is None or not hasattr(lib, "mallopt") or os.environ.get("ENTOSCOPE_MALLOC", "") == "system":
        return False
    _steady = bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _steady


ROOMY_MMAP_THRESHOLD = 512 * 2**20


@contextmanager
def roomy_heap() -> Iterator[None]:
    """Within: freed blocks up to ROOMY_MMAP_THRESHOLD stay on the heap for the next allocation; on leaving,
    the steady thresholds are put back and the free pages returned (malloc_trim). For a loop of equal-sized
    chunk temporaries (the bootstrap of 70,000 circuit edges: 64 MiB a chunk), whose fresh pages each cost a
    fault: on this project's 2-core VM such faults took half the bootstrap's time (a 70,651-edge summary of 24
    prompts: 12-17 s with the steady heap, 8.8-9.1 s within once the heap is warm; docs/speed.md). Nothing is done where the heap is not steady."""
    lib = _libc() if _steady else None
    if lib is None:
        yield
        return
    lib.mallopt(M_MMAP_THRESHOLD, ROOMY_MMAP_THRESHOLD)
    lib.mallopt(M_TRIM_THRESHOLD, 2 * ROOMY_MMAP_THRESHOLD)
    try:
        yield
    finally:
        lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        lib.malloc_trim(0)


def give_back_memory() -> None:
    """Collect garbage, then return the allocator's free pages to the system (glibc only)."""
    gc.collect()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
