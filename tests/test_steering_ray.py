"""Steering on Ray (a local cluster of 2 CPUs started here): 2 workers give the in-process run bit for bit, with a
direction the run makes itself (its sharded phase, then the driver's mean difference), continuations and side
effects; a run interrupted after some shards resumes from its folder. Skipped where ray is missing; CI sets
ENTOSCOPE_REQUIRE_RAY=1 so that a missing ray fails instead (tests/test_ray.py's pattern)."""


import numpy as np
import pytest

from extras import require

ray = require("ray")

import entoscope as es  # noqa: E402
from tests.test_ray import _same  # noqa: E402

RAY2 = es.Ray(workers=2)




@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _op():
    return es.Steering(direction={"source": "mean_difference", "site": "resid_pre.2",
                                  "data": {"task": "greater_than", "n": 24, "seed": 100}},
                       coefficients=[-0.5, 0.25], metric="prob_diff", batch_size=8,
                       side_effects={"tasks": ["ioi", "greater_than"], "n": 12},
                       continuations={"prompts": 2, "tokens": 4, "sample": True}, stats={"n_boot": 100})


def test_steering_on_two_workers_equals_in_process(cluster, demo):
    data = {"task": "greater_than", "n": 16, "seed": 7}
    op = _op()
    here = op.run(demo, data, quiet=True)
    there = op.run(demo, data, executor=RAY2, quiet=True)
    assert there.manifest["executor"]["phases"] == ["direction", "steer"]
    assert there.manifest["executor"]["shards"] >= 4  # it really was split
    _same(here.table, there.table)
    _same(here.per_prompt, there.per_prompt)
    assert np.array_equal(here.extra["direction"].vector.numpy(), there.extra["direction"].vector.numpy())
    assert here.extra["continuations"].equals(there.extra["continuations"])


def test_an_interrupted_steering_run_resumes_from_its_shards(cluster, demo, tmp_path):
    data = {"task": "greater_than", "n": 16, "seed": 8}
    op = _op()
    full = op.run(demo, data, quiet=True)
    shards = tmp_path / "shards"
    calls = {"n": 0}
    real = es.Steering.execute_shard

    def dies_after_three(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    es.Steering.execute_shard = dies_after_three
    try:
        with pytest.raises(KeyboardInterrupt):
            op.run(demo, data, quiet=True, shards_dir=shards)
    finally:
        es.Steering.execute_shard = real
    resumed = op.run(demo, data, quiet=True, shards_dir=shards, resume=True)
    assert resumed.manifest["executor"]["resumed_shards"] == 3
    _same(full.table, resumed.table)
    _same(full.per_prompt, resumed.per_prompt)
