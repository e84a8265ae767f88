"""What summarising a big sharded run costs: streamed from its shard files vs held in memory.

Synthetic per-prompt values (no model runs: the point is the driver's merge, summary and save) are
written as a sharded run writes them (shards of 64 prompts, in a shuffled order as length groups
interleave a dataset), then summarised two ways in the same script, each in a forked child so that
its peak resident memory is its own:

  streamed   StoredColumns (buckets of prompts on disk) -> the summary -> Result.save writing the
             per-prompt table block by block: what `run(..., shards_dir=...)` and Ray runs do now
  held       every prompt's arrays read into memory and the whole per-prompt DataFrame built before
             saving: what the driver did before (the baseline)

Cases (--n scales the first; --edges-n the second):
  patching   100,000 pairs x 180 sites (12 layers x 15 positions): table, intervals, per_prompt.parquet
             (and .csv with --csv), 18 million per-prompt rows
  eap        10,000 prompts x 32,491 edges (GPT-2 small's graph), float32: every edge's mean score with
             its interval (the circuits operation's edge table)
  stats      the statistics alone on arrays in memory: the block path (weighted sums, leave-one-out as
             g(total - x_i)) vs the whole-matrix path ([n_boot, n] weights, n re-evaluations), for
             1,000 / 4,000 / 16,000 prompts x 180 cells

Threads: numpy/BLAS and torch are limited to --threads (default 1) before anything is imported.

    python benchmarks/bench_merge.py [--n 100000] [--edges-n 10000] [--csv] [--only patching|eap|stats]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def write_shards(folder: Path, n: int, width: int, dtype: str, patching: bool, seed: int = 0):
    import numpy as np

    from entoscope.executors.shards import PerPrompt, Shard
    from entoscope.executors.store import ShardStore

    rng = np.random.default_rng(seed)
    store = ShardStore(folder, f"bench-{n}-{width}")
    order = rng.permutation(n)
    shards = []
    for i, lo in enumerate(range(0, n, 64)):
        ex = np.sort(order[lo:lo + 64])
        if patching:
            base = rng.normal(0.0, 1.0, len(ex))
            source = base + rng.normal(5.0, 1.0, len(ex))
            arrays = {"patched": base[:, None] + rng.uniform(0, 1, (len(ex), width)) * (source - base)[:, None],
                      "m_base": base, "m_source": source}
        else:
            arrays = {"scores": rng.normal(0.0, 1.0, (len(ex), width)).astype(dtype)}
        shard = Shard(i, (i,), tuple(ex.tolist()))
        store.write("main", shard, PerPrompt(ex, arrays))
        shards.append(shard)
    return [store.path("main", s) for s in shards], shards


def patching_job(paths, shards, n: int, width: int, held: bool, out: Path, csv: bool) -> None:
    import numpy as np
    import pandas as pd

    from entoscope.executors.columns import MemoryColumns, StoredColumns
    from entoscope.patching.compare import pair_values, prompt_table, site_table
    from entoscope.results.lazy import LazyTable
    from entoscope.results.result import Result
    from entoscope.stats import Stats

    cols = StoredColumns(paths, shards, n)
    if held:
        cols = MemoryColumns(cols.read(0, n), {}, n)
    values = pair_values(lambda lo, hi: cols.read(lo, hi, ["patched"])["patched"], width, cols["m_base"],
                         cols["m_source"], 0.0, 0.1)
    sites = pd.DataFrame({"site": [f"resid_pre.{i // 15}@{i % 15}" for i in range(width)],
                          "layer": np.arange(width) // 15, "position": np.arange(width) % 15})
    table, _ = site_table(values, sites, "normalized", "ratio_of_means", Stats(), 0, {})
    positions = sites["position"].to_numpy(float)[None]  # [1, sites]: the same positions in every prompt

    def rows(lo: int, hi: int) -> pd.DataFrame:
        block = {**values.block(lo, hi), "base": values.base[lo:hi], "source": values.source[lo:hi],
                 "degenerate": values.degenerate[lo:hi]}
        return prompt_table(block, sites, np.arange(lo, hi), np.repeat(positions, hi - lo, 0),
                            np.full((hi - lo, width), "tok", dtype=object))
    per_prompt = LazyTable(n, rows, rows_per_prompt=width)
    result = Result("patching", table, per_prompt=per_prompt.to_pandas() if held else per_prompt)
    if not csv:  # parquet only: the CSV of 18 million rows dominates both runs' time
        import entoscope.results.result as result_module
        result_module.pd.DataFrame.to_csv = lambda self, *a, **k: None
    result.save(out)


def eap_job(paths, shards, n: int, width: int, held: bool) -> None:
    from entoscope.executors.columns import MemoryColumns, StoredColumns
    from entoscope.stats import Stats, streamed_mean, summarise

    cols = StoredColumns(paths, shards, n)
    if held:
        cols = MemoryColumns(cols.read(0, n), {}, n)
    summarise(streamed_mean(n, width, lambda lo, hi: cols.read(lo, hi, ["scores"])["scores"], skip_nan=False),
              Stats(), 0)


def stats_case(threads: int) -> None:
    import numpy as np

    from common import PeakMemory
    from entoscope.stats import FunctionStat, Stats, mean_stat, summarise

    print("\n== statistics alone: block path vs whole-matrix path (180 cells, n_boot 1000, BCa)")
    print(f"{'prompts':>8} {'whole-matrix s':>15} {'block s':>9} {'speed-up':>9} {'memory whole/block':>19}")
    for n in (1000, 4000, 16000):
        x = np.random.default_rng(n).normal(size=(n, 180))
        whole = FunctionStat(lambda W, cols: (W @ x[:, cols]) / W.sum(1, keepdims=True), n, 180)
        runs = {}
        for name, stat in (("whole", whole), ("block", mean_stat(x))):
            with PeakMemory() as mem:
                t = time.perf_counter()
                s = summarise(stat, Stats(), seed=0)
                runs[name] = (time.perf_counter() - t, mem, s)
        np.testing.assert_allclose(runs["whole"][2].ci_low, runs["block"][2].ci_low, rtol=1e-9, atol=1e-12)
        tw, mw, _ = runs["whole"]
        tb, mb, _ = runs["block"]
        print(f"{n:>8} {tw:>15.2f} {tb:>9.2f} {tw / tb:>8.1f}x {mw.rise / max(1, mb.rise):>18.1f}x "
              f"({mw.rise / 2**20:.0f} / {mb.rise / 2**20:.0f} MiB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="pairs of the patching case")
    ap.add_argument("--edges-n", type=int, default=10_000, help="prompts of the EAP case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--csv", action="store_true", help="also write per_prompt.csv (slow: 18M rows)")
    ap.add_argument("--only", choices=["patching", "eap", "stats"])
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    from common import measured, set_threads

    set_threads(args.threads)
    print(f"threads {args.threads}; memory: peak resident set of a forked child above its start (MiB)")
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        if args.only in (None, "patching"):
            t = time.perf_counter()
            paths, shards = write_shards(folder / "patching", args.n, 180, "float64", True)
            print(f"\n== patching: {args.n:,} pairs x 180 sites ({args.n * 180 * 8 / 2**20:.0f} MiB of patched "
                  f"metrics, {len(shards)} shards written in {time.perf_counter() - t:.0f} s)", flush=True)
            res = {held: measured(patching_job, paths, shards, args.n, 180, held, folder / f"run-{held}", args.csv)
                   for held in (True, False)}
            (th, mh), (ts, ms) = res[True], res[False]
            print(f"  held in memory   {th:7.1f} s  {mh:8.0f} MiB")
            print(f"  streamed         {ts:7.1f} s  {ms:8.0f} MiB")
            print(f"  streamed / held: time {ts / th:.2f}x, peak memory {ms / mh:.3f}x", flush=True)
        if args.only in (None, "eap"):
            E = 32_491
            t = time.perf_counter()
            paths, shards = write_shards(folder / "eap", args.edges_n, E, "float32", False)
            print(f"\n== EAP edge scores: {args.edges_n:,} prompts x {E:,} edges, float32 "
                  f"({args.edges_n * E * 4 / 2**20:.0f} MiB; {len(shards)} shards written in "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            res = {held: measured(eap_job, paths, shards, args.edges_n, E, held) for held in (True, False)}
            (th, mh), (ts, ms) = res[True], res[False]
            print(f"  held in memory   {th:7.1f} s  {mh:8.0f} MiB")
            print(f"  streamed         {ts:7.1f} s  {ms:8.0f} MiB")
            print(f"  streamed / held: time {ts / th:.2f}x, peak memory {ms / mh:.3f}x", flush=True)
    if args.only in (None, "stats"):
        stats_case(args.threads)


if __name__ == "__main__":
    main()
