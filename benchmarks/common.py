"""Shared setup for the benchmarks: thread count, a GPT-2-small-sized random model built offline,
peak-memory measurement. Every benchmark reports ratios against a baseline run in the same script."""

from __future__ import annotations

import os
import resource
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
