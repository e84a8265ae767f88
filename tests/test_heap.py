"""heap.give_back_memory: freed heap pages return to the system (glibc), read from /proc/self/statm."""

from __future__ import annotations

import platform

import pytest

from entoscope.heap import _libc, give_back_memory


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's (macOS, musl: nothing to give)")
def test_freed_heap_below_a_live_object_is_returned():
    """200 MiB of buffers below the mmap threshold, every other one freed: holes between live buffers, which
    glibc's free never gives back, so their pages stay resident until malloc_trim hands back the free pages
    in the middle."""
    import ctypes

    assert _libc() is not None  # on glibc the trim must be found, not silently left out
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.malloc.argtypes = [ctypes.c_size_t]
    size = 64 * 1024 - 64  # below the mmap threshold: on the heap
    buffers = [libc.malloc(size) for _ in range(3200)]
    for b in buffers:
        ctypes.memset(b, 1, size)  # touched: resident
    for b in buffers[::2]:  # every other one: holes between live buffers of the same size
        libc.free(b)
    before = _resident_mib()
    give_back_memory()
    after = _resident_mib()
    for b in buffers[1::2]:
        libc.free(b)
    assert before - after > 60, (before, after)  # 100 MiB of holes, less their chunks' partial pages


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_roomy_heap_keeps_a_freed_block_until_it_ends():
    """With the steady heap a freed 64 MiB block leaves at once (mmap'd); within roomy_heap it stays resident
    for the next allocation to reuse, and leaving gives it back (read from /proc/self/statm)."""
    import ctypes

    from entoscope.heap import roomy_heap, steady_heap

    assert steady_heap()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 * 2**20

    def touched_then_freed() -> float:
        b = libc.malloc(size)
        ctypes.memset(b, 1, size)
        held = _resident_mib()
        libc.free(b)
        return held - _resident_mib()  # what the free gave back

    assert touched_then_freed() > 60  # steady: returned at once
    with roomy_heap():
        assert touched_then_freed() < 8  # kept on the heap
        before_leaving = _resident_mib()
    assert before_leaving - _resident_mib() > 60  # given back on leaving
    assert touched_then_freed() > 60  # and the steady threshold is back
