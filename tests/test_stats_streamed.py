"""Statistics read in blocks of prompts (stats/sums.py, stats/resample.py) against the whole-matrix path.

The whole-matrix path (a FunctionStat: every resample's weights [n_boot, n] at once, leave-one-out by
n re-evaluations) is the definition; the block path must give the same numbers on datasets large
enough to span several weight chunks (> 4096 prompts) and several read blocks."""

from __future__ import annotations

import numpy as np
import pytest

from entoscope.stats import (FunctionStat, RatioStat, Resampler, Stats, mean_stat, resample_weights, streamed_mean,
                             summarise)
from entoscope.stats.resample import WEIGHT_CHUNK
from entoscope.stats.sums import block_rows


def _as_function(num: np.ndarray, den: np.ndarray) -> FunctionStat:
    """The same ratio of weighted sums, evaluated on whole weight matrices."""
    def fn(W, cols):
        a, d = W @ num[:, cols], W @ den[:, cols]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(d != 0, a / np.where(d != 0, d, 1.0), np.nan)
    return FunctionStat(fn, num.shape[0], num.shape[1])


def _assert_same(a, b, atol=1e-10):
    for key in ("value", "ci_low", "ci_high", "se", "p_value", "influence"):
        np.testing.assert_allclose(getattr(a, key), getattr(b, key), atol=atol, rtol=1e-9, err_msg=key)
    np.testing.assert_array_equal(a.influential, b.influential)
    np.testing.assert_array_equal(a.p_bound, b.p_bound)


def test_resampling_counts_over_several_chunks_are_multinomial():
    n, B = 2 * WEIGHT_CHUNK + 300, 400
    W = resample_weights(n, B, seed=7)
    assert W.shape == (B, n) and (W.sum(1) == n).all()  # each row draws n prompts
    # every prompt is drawn Binomial(n, 1/n) times: mean 1, variance (1 - 1/n)
    assert abs(W.mean() - 1) < 1e-12
    assert abs(W.var() - (1 - 1 / n)) < 0.01
    # the chunks' totals are multinomial with probabilities size / n: their mean is n * size / n = size
    sizes = [WEIGHT_CHUNK, WEIGHT_CHUNK, 300]
    edges = np.cumsum([0] + sizes)
    totals = np.stack([W[:, a:b].sum(1) for a, b in zip(edges[:-1], edges[1:])], 1)
    np.testing.assert_allclose(totals.mean(0), sizes, rtol=0.02)
    # any block of prompts is the same slice of the whole matrix, asked in any order
    r = Resampler(n, B, seed=7)
    lo, hi = WEIGHT_CHUNK + 5, 2 * WEIGHT_CHUNK + 17
    np.testing.assert_array_equal(r.block(lo, hi), W[:, lo:hi])
    np.testing.assert_array_equal(r.block(0, 10), W[:, :10])


def test_a_small_dataset_keeps_numpys_single_multinomial():
    n, B, seed = 50, 30, 3
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xB007]))
    np.testing.assert_array_equal(resample_weights(n, B, seed), rng.multinomial(n, np.full(n, 1 / n), size=B))


@pytest.mark.parametrize("method", ["bca", "expanded_percentile", "percentile"])
def test_block_summary_of_a_mean_over_several_chunks_equals_the_whole_matrix_path(method):
    rng = np.random.default_rng(0)
    n = WEIGHT_CHUNK + 1500
    x = rng.gamma(2.0, 1.5, size=(n, 3))  # skewed, so BCa's acceleration matters
    x[::97, 1] = np.nan  # cell 1 skips some prompts
    stats = Stats(n_boot=300, ci_method=method, refine_p=False)  # the interval paths (no refinement)
    streamed = summarise(mean_stat(x), stats, seed=2)
    ok = np.isfinite(x)
    whole = summarise(_as_function(np.where(ok, x, 0.0), ok.astype(float)), stats, seed=2)
    _assert_same(streamed, whole)
    np.testing.assert_allclose(streamed.value, np.nanmean(x, 0), rtol=1e-12)


@pytest.mark.parametrize("cells_per_chunk", [None, 50 * 1000])
def test_block_summary_of_a_wide_ratio_over_several_read_blocks_equals_the_whole_matrix_path(monkeypatch,
                                                                                             cells_per_chunk):
    """cells_per_chunk 50 x 1000: the resamples' sums are accumulated 1,000 columns at a time (as for the
    70,651 edges of SmolLM2's graph at 1,000 resamples), the same numbers."""
    import entoscope.stats.bootstrap as bootstrap

    if cells_per_chunk is not None:
        monkeypatch.setattr(bootstrap, "CELLS_PER_CHUNK", cells_per_chunk)
    rng = np.random.default_rng(1)
    n, U = 300, 20_000  # 20,000 cells: blocks of block_rows(...) < n prompts
    assert block_rows(2 * U) < n
    num = rng.normal(size=(n, U))
    den = rng.normal(1.0, 0.3, size=(n, U))
    stats = Stats(n_boot=50, refine_p=False)
    _assert_same(summarise(RatioStat(num, den), stats, seed=5), summarise(_as_function(num, den), stats, seed=5))


def test_a_streamed_mean_reads_each_block_once_per_pass_and_matches_the_in_memory_mean():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(WEIGHT_CHUNK + 77, 4))
    reads = []

    def read(lo, hi):
        reads.append((lo, hi))
        return x[lo:hi]
    s = summarise(streamed_mean(len(x), 4, read, skip_nan=False), Stats(n_boot=100), seed=1)
    _assert_same(s, summarise(mean_stat(x), Stats(n_boot=100), seed=1), atol=0)
    blocks = sorted(set(reads))
    assert reads == blocks + blocks  # two passes: sums and resamples, then leave-one-out
    assert blocks[0][0] == 0 and blocks[-1][1] == len(x) and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_leave_one_out_influence_is_exact_for_a_ratio_of_means():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(40, 2)), rng.normal(3.0, 1.0, size=(40, 2))
    a[7] += 25.0  # one prompt carries the cells
    s = summarise(RatioStat(a, b), Stats(n_boot=0), seed=0)
    loo = np.stack([np.delete(a, i, 0).sum(0) / np.delete(b, i, 0).sum(0) for i in range(40)])
    value = a.sum(0) / b.sum(0)
    np.testing.assert_allclose(s.influence, np.abs(loo - value).max(0), rtol=1e-10)
    np.testing.assert_array_equal(s.influential, [7, 7])
