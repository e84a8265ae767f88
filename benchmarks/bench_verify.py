"""What verifying shard files costs (executors/store.py): their SHA-256 written with them, checked on
resume and again by the streamed merge.

Synthetic per-prompt values (8,192 prompts x 200 sites float64 in shards of 64, shuffled as length
groups interleave a dataset; no model runs) are written and merged twice in the same process: as
entoscope does now, and with the checksum replaced by a constant and the merge's verified read by a
plain Parquet read (the baseline: what the store did before). CPU time (time.process_time), best of 3;
numpy on one thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_verify.py [--n 8192] [--width 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    import pyarrow.parquet as pq

    from entoscope.executors import store as st
    from entoscope.executors.columns import StoredColumns
    from entoscope.executors.shards import PerPrompt, Shard

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--width", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    store = st.ShardStore(Path(tempfile.mkdtemp()) / "shards", "bench")
    order, parts = rng.permutation(args.n), []
    for i, lo in enumerate(range(0, args.n, 64)):
        ex = np.sort(order[lo:lo + 64])
        parts.append((Shard(i, (i,), tuple(ex.tolist())),
                      PerPrompt(ex, {"patched": rng.normal(size=(len(ex), args.width)), "m": rng.normal(size=len(ex))})))
    shards = [s for s, _ in parts]
    paths, expect = [store.path("main", s) for s in shards], [store.identity("main", s) for s in shards]
    write_on = _best(lambda: [store.write("main", s, p) for s, p in parts])
    merge_on = _best(lambda: StoredColumns(paths, shards, args.n, expect))
    resume = _best(lambda: (store._verified.clear(), [store.has("main", s) for s in shards]))
    st.content_digest = lambda table: "unchecked"  # the baseline: no checksum, a plain read
    write_off = _best(lambda: [store.write("main", s, p) for s, p in parts])
    st.open_shard = lambda path, expect=None: (pq.read_table(path), None)
    merge_off = _best(lambda: StoredColumns(paths, shards, args.n, expect))
    mib = args.n * args.width * 8 / 2**20
    print(f"{len(shards)} shards, {mib:.0f} MiB of values")
    print(f"write  {write_on:.3f} s vs {write_off:.3f} s unchecked: {write_on / write_off:.2f}x")
    print(f"merge  {merge_on:.3f} s vs {merge_off:.3f} s unchecked: {merge_on / merge_off:.2f}x")
    print(f"--resume's check of every shard: {resume:.3f} s ({resume / merge_off:.2f}x one unchecked merge)")


if __name__ == "__main__":
    main()
