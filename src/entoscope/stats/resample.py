"""Bootstrap resampling weights, generated block by block so that no [n_boot, n] matrix is ever needed.

A resample draws n prompts with replacement: a row of multinomial counts over the n prompts. For a
large dataset the [n_boot, n] matrix is the one thing that grows with both, so the counts are made
per chunk of WEIGHT_CHUNK consecutive prompts, still exactly multinomial: first each row's total
is split over the chunks (multinomial over the chunks, probabilities proportional to their sizes),
then each chunk's share over its prompts (a multinomial per row, uniform over the chunk). Each
chunk has its own seeded stream, so chunk c's counts are the same whichever chunks were made before.

With n <= WEIGHT_CHUNK there is one chunk and the counts are numpy's multinomial(n, 1/n, size=n_boot)
from the stream SeedSequence([seed, 0xB007]) (what every run of a smaller dataset has always used).
"""

from __future__ import annotations

import numpy as np

WEIGHT_CHUNK = 4096  # prompts whose resampling counts are made together ([n_boot, 4096] float64 at a time)


def _rng(seed: int, chunk: int | None) -> np.random.Generator:
    key = [int(seed), 0xB007] if chunk is None else [int(seed), 0xB007, chunk]
    return np.random.default_rng(np.random.SeedSequence(key))


class Resampler:
    """The counts of `n_boot` resamples of n prompts, for any range of prompts, made one chunk at a time."""

    def __init__(self, n: int, n_boot: int, seed: int) -> None:
        self.n, self.n_boot, self.seed = n, n_boot, seed
        self.n_chunks = max(1, -(-n // WEIGHT_CHUNK))
        self._split = None
        if self.n_chunks > 1:  # each row's n draws split over the chunks first
            sizes = np.array([min(WEIGHT_CHUNK, n - c * WEIGHT_CHUNK) for c in range(self.n_chunks)], dtype=float)
            self._split = _rng(seed, 0).multinomial(n, sizes / n, size=n_boot)  # [n_boot, n_chunks]
        self._cached: tuple[int, np.ndarray] | None = None

    def chunk(self, c: int) -> np.ndarray:
        """[n_boot, size of chunk c] float64 counts of chunk c's prompts."""
        if self._cached is not None and self._cached[0] == c:
            return self._cached[1]
        lo = c * WEIGHT_CHUNK
        size = min(WEIGHT_CHUNK, self.n - lo)
        uniform = np.full(size, 1.0 / size)
        if self._split is None:
            counts = _rng(self.seed, None).multinomial(self.n, uniform, size=self.n_boot)
        else:
            counts = _rng(self.seed, c + 1).multinomial(self._split[:, c], uniform)
        block = counts.astype(np.float64)
        self._cached = (c, block)
        return block

    def block(self, lo: int, hi: int) -> np.ndarray:
        """[n_boot, hi - lo] counts of prompts lo..hi-1."""
        parts = []
        for c in range(lo // WEIGHT_CHUNK, -(-hi // WEIGHT_CHUNK)):
            start = c * WEIGHT_CHUNK
            parts.append(self.chunk(c)[:, max(lo, start) - start: min(hi, start + WEIGHT_CHUNK) - start])
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def resample_weights(n: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n] multinomial counts: each row resamples the n prompts with replacement (seeded).

    The whole matrix, for statistics given as a function of the weights; streamed statistics ask a
    `Resampler` for one block of prompts at a time and see the same counts."""
    if n == 0:
        return np.zeros((n_boot, 0))
    return Resampler(n, n_boot, seed).block(0, n)
