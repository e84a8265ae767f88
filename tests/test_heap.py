"""heap.give_back_memory: freed heap pages return to the system (glibc), read from /proc/self/statm."""

from __future__ import annotations

import sys

import pytest

from entoscope.heap import _libc, give_back_memory


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or _libc() is None, reason="glibc's malloc_trim only")
def test_freed_heap_below_a_live_object_is_returned():
    """200 MiB of small buffers freed under a buffer allocated after them: glibc cannot shrink its heap from the
    top, so the pages stay resident until malloc_trim hands back the free ones in the middle."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.malloc.argtypes = [ctypes.c_size_t]
    chunks = [libc.malloc(64 * 1024 - 64) for _ in range(3200)]  # below the mmap threshold: on the heap
    for c in chunks:
        ctypes.memset(c, 1, 64 * 1024 - 64)  # touched: resident
    top = libc.malloc(1024)
    ctypes.memset(top, 1, 1024)
    for c in chunks:
        libc.free(c)
    before = _resident_mib()
    give_back_memory()
    after = _resident_mib()
    libc.free(top)
    assert before - after > 150, (before, after)
