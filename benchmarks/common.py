"""Shared setup for the benchmarks: thread count, a GPT-2-small-sized random model built offline,
peak-memory measurement. Every benchmark reports ratios against a baseline run in the same script."""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def set_threads(n: int) -> int:
    import torch

    torch.set_num_threads(n)
    return n


def gpt2_small(backend: str = "bridge", seed: int = 0) -> Any:
    """GPT-2 small's shape (12 layers, 12 heads, d_model 768, vocab 50257), random weights, offline.
    The tokenizer is the tiny test one (ids < 320): benchmarks feed token ids."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).eval()
    hf.config._attn_implementation = "eager"
    return from_hf(hf, tiny_tokenizer(), backend=backend, name="gpt2-small-random", folder=tokenizer_dir())


def random_prompts(n: int, length: int, seed: int = 0, vocab: int = 320) -> list[tuple[int, ...]]:
    import random

    rng = random.Random(seed)
    return [tuple([0] + [rng.randrange(1, vocab) for _ in range(length - 1)]) for _ in range(n)]


@contextmanager
def timer(store: dict[str, float], key: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    store[key] = time.perf_counter() - t


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measured(fn: Any, *args: Any) -> tuple[float, float]:
    """Run fn(*args) in a forked child: (seconds, peak memory above the fork point in MiB).
    Each measurement gets its own process, so peaks of earlier runs do not hide later ones."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        base = current_rss_mib()
        t = time.perf_counter()
        fn(*args)
        q.put((time.perf_counter() - t, peak_rss_mib() - base))

    p = ctx.Process(target=child)
    p.start()
    out = q.get()
    p.join()
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated_reader():
    """A function giving the bytes malloc has handed out now (glibc >= 2.33), else the resident set size."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def allocated() -> int:
            info = libc.mallinfo2()
            return info.uordblks + info.hblkhd  # heap in use + mmap-ed blocks (torch's big tensors)
        allocated()
        return allocated, "bytes allocated (glibc mallinfo2)"
    except (OSError, AttributeError):
        import resource

        return (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "max resident set size"


ALLOCATED, MEMORY_MEASURE = _allocated_reader()


class PeakMemory:
    """Largest rise of allocated memory during the `with` block, sampled every millisecond in a thread."""

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = ALLOCATED()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, ALLOCATED())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, ALLOCATED())
        self.rise = self.peak - self.start


def best_of(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` calls of fn(), in seconds (the least disturbed by other jobs)."""
    import time

    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
