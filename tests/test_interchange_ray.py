"""An interchange grid (DAS and fixed bases over layers x roles) on a local two-worker Ray cluster equals the
in-process table: the read and eval phases run as shards on the workers, the bases (DAS trained) on the
driver from the merged reads, so every IIA, interval and principal angle is the same number. Skipped where
ray is missing; CI sets ENTOSCOPE_REQUIRE_RAY=1 so that a missing ray fails instead."""

from __future__ import annotations


import numpy as np
import pandas as pd

from extras import require

import entoscope as es

ray = require("ray")




def test_interchange_grid_on_two_workers_equals_in_process(cluster):
    demo = es.load_model("demo")
    data = es.tasks.ioi(n=24, seed=5)
    op = es.Interchange(variable="io", layers=[0, 1], positions=["S2", "END"], rank=1, epochs=2,
                        bases=["das", "mean_difference", "pca", "random"], batch_size=8, seed=0)
    here = op.run(demo, data, quiet=True)
    there = op.run(demo, data, executor=es.Ray(workers=2), quiet=True)
    assert there.manifest["executor"]["shards"] >= 2  # it really was split
    a, b = here.table, there.table
    assert list(a.columns) == list(b.columns) and len(a) == len(b) == 4 * (1 + 1 + 4 + 3)
    for col in a.columns:
        if pd.api.types.is_float_dtype(a[col]):
            np.testing.assert_array_equal(a[col].to_numpy(float), b[col].to_numpy(float), err_msg=col)
        else:
            assert a[col].tolist() == b[col].tolist(), col
    for k, bases in enumerate(here.extra["bases"]):
        for name, basis in bases.items():
            np.testing.assert_array_equal(basis, there.extra["bases"][k][name], err_msg=name)


def test_greater_than_year_sets_on_two_workers_equal_in_process(cluster):
    """The workers rebuild the pairs from the saved prompts: greater_than's year sets (the output read by its
    probability mass) must travel with them, or the workers' IIA would differ."""
    demo = es.load_model("demo")
    data = es.tasks.greater_than(n=16, seed=2)
    op = es.Interchange(variable="yy", layers=[1, 2], positions=["YY", "END"], bases=["pca", "mean_difference"],
                        rank=2, batch_size=8, seed=0)
    here = op.run(demo, data, quiet=True)
    there = op.run(demo, data, executor=es.Ray(workers=2), quiet=True)
    assert there.manifest["executor"]["shards"] >= 2
    pd.testing.assert_frame_equal(here.table, there.table, check_exact=True)
    assert here.table["iia"].max() > here.table["iia"].min()  # not a constant table: something was measured
