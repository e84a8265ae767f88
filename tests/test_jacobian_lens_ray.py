"""The Jacobian lens fit on two Ray workers equals the in-process fit (shards of prompts; docs/scale.md)."""


import pytest

from extras import require
import torch

pytestmark = pytest.mark.slow  # a local Ray cluster (CI runs them: -m slow)

ray = require("ray")

import entoscope as es  # noqa: E402




def test_the_fit_on_two_workers_equals_in_process(cluster):
    model = es.load_model("demo")
    data = es.tasks.get("corpus", n=6, seed=2)
    op = es.JacobianLensFit(max_length=40, batch_size=2)
    here = op.run(model, data, quiet=True)
    there = op.run(model, data, quiet=True, executor=es.Ray(workers=2))
    assert there.manifest["executor"]["shards"] == 3
    for layer in (0, 1):  # float64 sums added in shard order, one batch per shard: bit for bit
        assert torch.equal(here.extra["lens"].jacobians[layer], there.extra["lens"].jacobians[layer])
