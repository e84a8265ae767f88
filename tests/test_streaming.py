"""A run whose shards are on disk summarises them block by block (issue: "100,000 prompts never need all
per-prompt tables in memory at once").

Two kinds of check:
- equality: every sharded operation run with its shards written to disk (so the merge streams them
  through buckets of prompts, with buckets, blocks and table blocks made tiny here so that every
  read spans several) gives the table, the per-prompt table and the saved files of the run held in
  memory, bit for bit;
- memory: summarising 32,768 synthetic prompts x 200 patched sites from their shard files allocates
  a small share of their per-prompt values (numpy allocations, traced by tracemalloc), the same as for
  8,192 prompts, while holding them in memory allocates more than all of them.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pandas as pd
import pytest

import entoscope as es
from entoscope.executors import columns as columns_module
from entoscope.executors.columns import MemoryColumns, StoredColumns
from entoscope.executors.shards import PerPrompt, Shard
from entoscope.executors.store import ShardStore
from entoscope.patching.compare import pair_values, site_table
from entoscope.results import lazy
from entoscope.stats import Stats
from entoscope.stats import sums

FAST = Stats(n_boot=50)


@pytest.fixture()
def tiny_blocks(monkeypatch):
    """Blocks of a few prompts everywhere: statistics, buckets on disk, per-prompt table blocks."""
    monkeypatch.setattr(sums, "BLOCK_FLOATS", 256)
    monkeypatch.setattr(columns_module, "BUCKET_BYTES", 512)
    monkeypatch.setattr(lazy, "BLOCK_ROWS", 40)


def _same_tables(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_exact=True)


OPERATIONS = {
    "patching": (lambda: es.Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"]), stats=FAST),
                 {"task": "ioi", "n": 24, "seed": 1}),
    "circuits": (lambda: es.Circuits(method="eap", n_edges=20, faithfulness=[0.1, 0.5, 1.0], stability=8, stats=FAST),
                 {"task": "ioi", "n": 24, "seed": 1}),
    "circuits_target": (lambda: es.Circuits(method="eap_ig", steps=2, selection="target", max_edges=52,
                                            faithfulness=[0.05, 0.2, 1.0], stability=8, stats=FAST),
                        {"task": "ioi", "n": 24, "seed": 1}),
    "lens": (lambda: es.Lens(stats=FAST), {"task": "ioi", "n": 24, "seed": 1}),
    "dla": (lambda: es.DirectLogitAttribution(stats=FAST), {"task": "ioi", "n": 24, "seed": 1}),
    "head_scores": (lambda: es.HeadScores(stats=FAST), {"task": "induction", "n": 24, "seed": 1}),
    "ifr": (lambda: es.InformationFlowRoutes(stats=FAST), {"task": "ioi", "n": 24, "seed": 1}),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_run_streamed_from_its_shard_files_equals_the_run_held_in_memory(name, tiny_blocks, tmp_path):
    make, data = OPERATIONS[name]
    model = es.load_model("demo")
    held = make().run(model, data, quiet=True)
    streamed = make().run(model, data, quiet=True, shards_dir=tmp_path / "shards")
    assert len(list((tmp_path / "shards").glob("*.parquet"))) >= 3  # several shards, merged from disk
    _same_tables(streamed.table, held.table)
    _same_tables(streamed.per_prompt, held.per_prompt)
    held.save(tmp_path / "held")
    streamed.save(tmp_path / "streamed")
    for f in ("per_prompt.csv", "table.csv"):  # written block by block, the same bytes
        assert (tmp_path / "streamed" / f).read_bytes() == (tmp_path / "held" / f).read_bytes()
    _same_tables(pd.read_parquet(tmp_path / "streamed" / "per_prompt.parquet"), held.per_prompt)
    if name.startswith("circuits"):
        assert streamed.summary == held.summary
    if name == "circuits_target":  # the search's steps ran shard by shard, each point chosen on the driver
        assert held.summary["found"] and held.summary["search_points"] > 3
        _same_tables(streamed.extra["search"], held.extra["search"])
    if name == "patching":  # read from the shards' buckets on first use
        assert "patched" in streamed.extra and set(streamed.extra) == set(held.extra)
        np.testing.assert_array_equal(streamed.extra["patched"].numpy(), held.extra["patched"].numpy())


N_SITES = 200


def _write_shards(folder, n: int, rng: np.random.Generator) -> tuple[list, list[Shard]]:
    """n pairs' patched / base / source metrics in shards of 64 prompts in a shuffled order (as length
    groups interleave the dataset)."""
    store = ShardStore(folder, f"synthetic-{n}")
    order = rng.permutation(n)
    shards = []
    for i, lo in enumerate(range(0, n, 64)):
        ex = np.sort(order[lo:lo + 64])
        base = rng.normal(0.0, 1.0, len(ex))
        source = base + rng.normal(5.0, 1.0, len(ex))
        patched = base[:, None] + rng.uniform(0, 1, (len(ex), N_SITES)) * (source - base)[:, None]
        shard = Shard(i, (i,), tuple(ex.tolist()))
        store.write("main", shard, PerPrompt(ex, {"patched": patched, "m_base": base, "m_source": source}))
        shards.append(shard)
    return [store.path("main", s) for s in shards], shards


def _summary(cols) -> pd.DataFrame:
    values = pair_values(lambda lo, hi: cols.read(lo, hi, ["patched"])["patched"], N_SITES, cols["m_base"],
                         cols["m_source"], 0.0, 0.1)
    sites = pd.DataFrame({"site": [f"s{i}" for i in range(N_SITES)]})
    return site_table(values, sites, "normalized", "ratio_of_means", Stats(n_boot=100), 0, {})[0]


def _traced_peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_summarising_stored_shards_allocates_a_small_share_that_does_not_grow_with_the_prompts(tmp_path, monkeypatch):
    # blocks of 2^16 values and buckets of 1 MiB (the defaults, 2^22 and 64 MiB, are sized for real runs
    # and would not be a small share of this 50 MiB test)
    monkeypatch.setattr(sums, "BLOCK_FLOATS", 1 << 16)
    monkeypatch.setattr(columns_module, "BUCKET_BYTES", 1 << 20)
    # the p-values' sign-flip refinement (stats/signflip.py) holds CHUNK_FLOATS values at once by design, sized for
    # real runs like the blocks above; this test measures the streamed summary itself, so it is left out here
    from entoscope.stats import bootstrap

    monkeypatch.setattr(bootstrap, "refine", lambda p, bound, *args: (p, bound, np.zeros(p.shape, dtype=bool)))
    rng = np.random.default_rng(0)
    peaks = {}
    for n in (8192, 32768):
        paths, shards = _write_shards(tmp_path / str(n), n, rng)
        table, peaks[n] = _traced_peak(lambda: _summary(StoredColumns(paths, shards, n)))
        whole = n * N_SITES * 8  # the patched metrics alone, float64
        if n == 32768:
            def held():  # what holding every prompt's values means: the merged arrays, then the same summary
                c = StoredColumns(paths, shards, n)
                return _summary(MemoryColumns(c.read(0, n), {}, n))
            in_memory, held_peak = _traced_peak(held)
            _same_tables(table, in_memory)
            assert held_peak > whole  # the measure sees a whole per-prompt array when there is one
            assert peaks[n] < whole / 4, (peaks[n], whole)
    assert peaks[32768] < 1.25 * peaks[8192], peaks  # 4x the prompts, not 4x the memory


def test_a_big_in_process_run_streams_its_shards_through_a_temporary_folder(monkeypatch, tmp_path):
    from entoscope.executors import driver

    made = []
    monkeypatch.setattr(driver, "IN_MEMORY_PROMPTS", 10)  # 24 prompts count as a big run here
    monkeypatch.setattr(driver, "StoredColumns", lambda *a: made.append(StoredColumns(*a)) or made[-1])
    monkeypatch.setattr(driver.tempfile, "tempdir", str(tmp_path))  # where the temporary shard folder goes
    make, data = OPERATIONS["patching"]
    model = es.load_model("demo")
    plan = make().plan(model, data)
    assert any("temporary shard folder" in note for note in plan.notes)
    streamed = make().run(model, data, quiet=True)
    assert len(made) == 1 and made[0].n == 24  # merged from the shard files
    assert not list(tmp_path.glob("entoscope-shards-*"))  # and the folder removed after the merge
    monkeypatch.setattr(driver, "IN_MEMORY_PROMPTS", 4096)
    _same_tables(streamed.table, make().run(model, data, quiet=True).table)
    assert len(made) == 1  # the small run kept its one shard in memory
