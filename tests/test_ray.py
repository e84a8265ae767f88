"""The Ray executor on a real local cluster (127.0.0.1, 2 CPUs, started here and stopped after): 2 workers
give the in-process tables (patching, EAP-IG with faithfulness, probing, the lens, IFR) on the demo model; a
worker killed by pid mid-run is restarted and its shard re-run; a driver interrupted after some shards
resumes from the run folder; a model with no load source is refused with the remedy.

The reference is always the in-process run of the same operation: the same functions run on the same
batches, so the tables are equal bit for bit (every row, site and prompt once, in the same order). Skipped where ray is missing; CI sets
ENTOSCOPE_REQUIRE_RAY=1 so that a missing ray fails instead."""

import os
import signal
import threading
import time

import numpy as np
import pandas as pd
import pytest

from extras import require
import torch

pytestmark = pytest.mark.slow  # a local Ray cluster: a minute and more (CI runs them: -m slow)

ray = require("ray")

import entoscope as es  # noqa: E402
from entoscope.cli import main  # noqa: E402
from entoscope.errors import ConfigError, SaveError  # noqa: E402
from entoscope.executors import ray_pool, store  # noqa: E402
from entoscope.executors.spec import ModelSpec  # noqa: E402

RAY2 = es.Ray(workers=2)
SITES = es.Sites(activation="resid_pre", over=["layer", "position"])




@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _same(a, b, atol=0.0, rtol=0.0):
    """Same rows, columns and order; numbers within atol + rtol * |value| (default: equal); the rest equal."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for col in a.columns:
        x, y = a[col], b[col]
        if pd.api.types.is_float_dtype(x) and pd.api.types.is_float_dtype(y):
            np.testing.assert_allclose(x.to_numpy(float), y.to_numpy(float), atol=atol, rtol=rtol, err_msg=col)
        else:
            assert x.tolist() == y.tolist(), col


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patching_on_two_workers_equals_in_process(cluster, demo, method):
    data = es.tasks.ioi(n=16, seed=1)
    op = es.Patching(method=method, sites=SITES)
    here = op.run(demo, data, quiet=True)
    there = op.run(demo, data, executor=RAY2, quiet=True)
    assert there.manifest["executor"]["shards"] >= 2  # it really was split
    assert sum(there.manifest["executor"]["shard_examples"]) == len(data)
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)
    assert there.per_prompt["example"].tolist() == here.per_prompt["example"].tolist()


def test_eap_ig_and_faithfulness_on_two_workers_equal_in_process(cluster, demo):
    data = es.tasks.ioi(n=8, seed=2)
    op = es.Circuits(method="eap_ig", steps=2, faithfulness=[0.05, 0.5, 1.0], n_edges=20, stats={"n_boot": 200})
    here = op.run(demo, data, quiet=True)
    there = op.run(demo, data, executor=RAY2, quiet=True)
    assert there.manifest["executor"]["phases"] == ["scores", "faithfulness"]
    _same(here.table, there.table)  # float32 edge scores
    _same(here.per_prompt, there.per_prompt)
    assert here.circuit.kept.equal(there.circuit.kept)  # the driver's global step chose the same circuit
    for key in ("faithfulness", "cpr", "cmd", "m_full", "m_empty", "m_circuit"):
        assert there.summary[key] == here.summary[key]
    _same(here.extra["curve"], there.extra["curve"])


def test_probing_and_lens_on_two_workers_equal_in_process(cluster, demo):
    data = es.tasks.ioi(n=12, seed=3)
    probe = es.Probing(sites=es.Sites(activation="resid_post", over=["layer"]), k=3)
    here, there = probe.run(demo, data, quiet=True), probe.run(demo, data, executor=RAY2, quiet=True)
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]))
    here, there = lens.run(demo, data, quiet=True), lens.run(demo, data, executor=RAY2, quiet=True)
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)
    ifr = es.InformationFlowRoutes()
    here, there = ifr.run(demo, data, quiet=True), ifr.run(demo, data, executor=RAY2, quiet=True)
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)


def test_head_scores_dla_and_tuned_lens_data_on_two_workers_equal_in_process(cluster, demo):
    data = es.tasks.induction(n=12, seed=6)
    for op in (es.HeadScores(), es.DirectLogitAttribution()):
        here, there = op.run(demo, data, quiet=True), op.run(demo, data, executor=RAY2, quiet=True)
        assert there.manifest["executor"]["shards"] >= 2
        _same(here.table, there.table)
        if here.per_prompt is not None:
            _same(here.per_prompt, there.per_prompt)
    losses = [es.TunedLens.for_model(demo).fit(demo, data, steps=3, batch_size=4, quiet=True, executor=ex)
              for ex in (None, RAY2)]
    assert losses[0] == losses[1]  # the same batches of states and logits, so the same training


def test_a_confirmed_run_on_two_workers_equals_the_confirmed_run_in_process(cluster, demo):
    """confirm (issue 34) on Ray: the screen and the confirmation on fresh prompts (a second Ray run) give the
    in-process tables bit for bit: patching (the confirmation patches only the top sites) and head scores
    (the whole grid again, the top rows read)."""
    sites = {"activation": "z", "over": ["layer", "head"]}
    for op, data in ((es.Patching(sites=sites, confirm={"k": 3, "n": 12}), {"task": "ioi", "n": 12, "seed": 3}),
                     (es.HeadScores(confirm={"k": 4}), {"task": "induction", "n": 12, "seed": 6})):
        here, there = op.run(demo, data, quiet=True), op.run(demo, data, executor=RAY2, quiet=True)
        assert there.manifest["executor"]["shards"] >= 2
        _same(here.table, there.table)
        _same(here.confirmation, there.confirmation)
        assert len(there.confirmation) == op.confirm.k


def test_a_killed_worker_is_restarted_and_nothing_is_lost_or_doubled(cluster, demo, tmp_path):
    data = es.tasks.ioi(n=32, seed=4)
    op = es.Patching(method="exact", sites=es.Sites(activation="resid_pre", over=["layer"]))
    executor = es.Ray(workers=2)
    pool = ray_pool.pool_for(executor, ModelSpec.of(demo))
    before = pool.pids()
    folder = tmp_path / "shards"
    killed = []

    def kill_after_first_shard():
        deadline = time.time() + 60
        while time.time() < deadline and not list(folder.glob("main-*.parquet")):
            time.sleep(0.01)
        os.kill(before[0], signal.SIGKILL)
        killed.append(before[0])

    killer = threading.Thread(target=kill_after_first_shard)
    killer.start()
    there = op.run(demo, data, executor=executor, quiet=True, shards_dir=folder)
    killer.join()
    after = pool.pids()
    assert killed and before[0] not in after  # the worker really died and Ray started another
    assert len(list(folder.glob("main-*.parquet"))) == there.manifest["executor"]["shards"] == 4
    here = op.run(demo, data, quiet=True)
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)  # every prompt once, in order


def test_an_interrupted_driver_resumes_from_the_run_folder(cluster, demo, tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = ["patch", "--data", "{task: ioi, n: 32, seed: 5}", "--sites", "{activation: resid_pre, over: [layer]}",
            "--executor", "ray", "--workers", "2", "--out", str(out), "--quiet"]  # 4 batches of 8: 4 shards
    written = []
    real_write = store.ShardStore.write

    def write_then_interrupt(self, phase, shard, part):
        real_write(self, phase, shard, part)
        written.append(shard.id)
        if len(written) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the driver after two shards are on disk

    monkeypatch.setattr(store.ShardStore, "write", write_then_interrupt)
    assert main(argv) == 130
    monkeypatch.setattr(store.ShardStore, "write", real_write)
    first = set(written)
    assert sorted(p.name for p in (out / "shards").glob("main-*.parquet")) == \
        [f"main-{i:05d}.parquet" for i in sorted(first)]
    assert main(argv) == 2  # neither --resume nor --overwrite: refused, the shards are kept
    assert len(list((out / "shards").glob("main-*.parquet"))) == 2
    redone = []
    monkeypatch.setattr(store.ShardStore, "write",
                        lambda self, phase, shard, part: (redone.append(shard.id), real_write(self, phase, shard, part)))
    assert main(argv + ["--resume"]) == 0
    assert not set(redone) & first and len(first) + len(redone) == 4  # only the missing shards ran
    resumed = pd.read_parquet(out / "table.parquet")
    assert (out / "shards" / "store.json").exists()  # the saved run keeps its shards
    op = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"]))
    uninterrupted = op.run(demo, es.tasks.ioi(n=32, seed=5), quiet=True).table
    _same(uninterrupted, resumed, atol=0, rtol=0)


def test_a_model_without_load_source_is_refused_with_the_remedy():
    from entoscope.models.tiny import tiny_model

    model = tiny_model("gpt2")  # built in Python: nothing says how a worker could load it again
    with pytest.raises(ConfigError) as err:
        es.Patching(sites=SITES).plan(model, es.tasks.ioi(n=2), executor=RAY2)
    assert err.value.code == "no_model_source"
    assert "save it to a folder" in err.value.remedy and "factory" in err.value.remedy
    with pytest.raises(ConfigError) as err:  # ACDC's decisions are sequential: not sharded, said before any work
        es.Circuits(method="acdc").plan(es.load_model("demo"), es.tasks.ioi(n=2), executor=RAY2)
    assert err.value.code == "executor_unsupported"


def test_a_worker_that_cannot_start_reports_its_own_cause(cluster, demo):
    """A factory naming a module that does not exist: the worker's own ImportError, named, not worker_lost."""
    data = es.tasks.ioi(n=8, seed=1)
    op = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"]))
    with pytest.raises(ConfigError) as err:
        op.run(demo, data, executor=es.Ray(workers=1, factory="entoscope_no_such_module:make"), quiet=True)
    assert err.value.code == "factory_not_found" and "entoscope_no_such_module" in err.value.message
    here, there = op.run(demo, data, quiet=True), op.run(demo, data, executor=RAY2, quiet=True)  # resources freed
    _same(here.table, there.table)


def test_a_store_of_another_run_is_refused(tmp_path):
    s = store.ShardStore(tmp_path / "shards", "run-a")
    assert s.files() == []
    with pytest.raises(SaveError) as err:
        store.ShardStore(tmp_path / "shards", "run-b", resume=True)
    assert err.value.code == "resume_mismatch"
    with pytest.raises(SaveError) as err:
        store.ShardStore(tmp_path / "shards", "run-a")
    assert err.value.code == "run_unfinished"


def test_parquet_shards_round_trip_every_kind_of_array_and_stream_back_in_prompt_order(monkeypatch):
    from entoscope.executors import columns
    from entoscope.executors.shards import PerPrompt, Shard

    rng = np.random.default_rng(0)
    parts = [PerPrompt([2, 0], {"a": rng.normal(size=(2, 3, 4)), "b": np.array([True, False]),
                                "g": np.array(['{"x": 1}', "y"], dtype=object),
                                "f": rng.normal(size=2).astype(np.float32)}, sums={"s": np.ones((2, 2))}),
             PerPrompt([1], {"a": rng.normal(size=(1, 3, 4)), "b": np.array([True]), "g": np.array(["z"], dtype=object),
                             "f": np.ones(1, np.float32)}, sums={"s": np.ones((2, 2))})]
    import tempfile

    monkeypatch.setattr(columns, "BUCKET_BYTES", 1)  # buckets of one prompt: every read spans several
    with tempfile.TemporaryDirectory() as d:
        st = store.ShardStore(d, "k")
        shards = [Shard(0, (0,), (2, 0)), Shard(1, (1,), (1,))]
        for s, p in zip(shards, parts):
            st.write("main", s, p)
        back = [st.read("main", s) for s in shards]
        streamed = columns.StoredColumns([st.path("main", s) for s in shards], shards, 3)
    m, direct = columns.merge(back, 3), columns.merge(parts, 3)
    for key in ("a", "b", "f", "s"):
        for got in (m[key], streamed[key]):
            np.testing.assert_array_equal(got, direct[key])
            assert got.dtype == direct[key].dtype
    assert m["g"].tolist() == streamed["g"].tolist() == ["y", "z", '{"x": 1}']
    np.testing.assert_array_equal(streamed.read(1, 3, ["a"])["a"], direct["a"][1:3])  # read after the shards are gone
    assert streamed.bucket == 1
    with pytest.raises(Exception) as err:
        columns.merge([parts[0], parts[0]], 3)
    assert getattr(err.value, "code", "") == "shards_incomplete"


def test_device_map_places_the_model_on_cpu_and_changes_no_number():
    data = es.tasks.ioi(n=2)
    placed = es.load_model("demo", device_map={"": "cpu"})
    assert placed._entoscope_source["device_map"] == {"": "cpu"}
    a = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(placed, data, quiet=True).table
    b = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(es.load_model("demo"), data,
                                                                           quiet=True).table
    _same(a, b)
    with pytest.raises(ConfigError) as err:
        es.load_model("demo", device="cpu", device_map="auto")
    assert err.value.code == "device_and_map"
    torch.manual_seed(0)
