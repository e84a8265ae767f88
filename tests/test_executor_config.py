"""The executor as a config (Python, YAML, CLI: three spellings of one object) and the plan of a sharded run,
none of which starts Ray; and shard planning over whole batches."""

import pytest

import entoscope as es
from entoscope.cli import main
from entoscope.config import executor_of
from entoscope.errors import ConfigError
from entoscope.executors.shards import batch_cap, plan_shards


def test_yaml_and_python_spell_the_same_executor():
    ex = executor_of({"executor": {"type": "ray", "workers": 4, "resources_per_worker": {"CPU": 2, "GPU": 1}}}, "e")
    assert ex == es.Ray(workers=4, resources_per_worker={"CPU": 2, "GPU": 1})
    assert executor_of({}, "e") == es.InProcess()
    assert executor_of({"executor": {"type": "ray", "workers": 4}}, "e", {"type": "in_process"}) == es.InProcess()
    with pytest.raises(ConfigError) as err:
        executor_of({"executor": {"type": "ray", "wrokers": 4}}, "entry")
    assert err.value.code == "config_invalid" and "entry.executor.wrokers: unknown key" in err.value.message
    with pytest.raises(ConfigError) as err:
        executor_of({"executor": {"type": "spark"}}, "entry")
    assert err.value.code == "unknown_executor"
    with pytest.raises(ConfigError):
        es.Ray(workers=0)
    assert es.Ray(factory="pkg.mod:make").model_dump()["factory"] == "pkg.mod:make"


def test_cli_plan_says_how_the_work_splits(capsys):
    code = main(["patch", "--data", "{task: ioi, n: 40}", "--sites", "{activation: resid_pre, over: [layer]}",
                 "--workers", "2", "--plan"])  # --workers alone means Ray; a plan starts no cluster
    out = capsys.readouterr().out
    assert code == 0
    assert "executor          ray: 5 shards over 2 workers" in out  # 40 prompts: batches of 8, one per shard
    assert "passes/worker" in out and "memory/worker" in out
    code = main(["circuit", "--data", "{task: ioi, n: 16}", "--executor", "ray", "--plan", "--quiet"])
    out = capsys.readouterr().out
    assert "on the driver     the circuit chosen from the merged edge scores" in out
    assert main(["patch", "--data", "ioi", "--executor", "in_process", "--workers", "2", "--plan"]) == 2
    assert main(["patch", "--data", "ioi", "--resume"]) == 2  # --resume needs --out
    assert "[resume_needs_folder]" in capsys.readouterr().err


def test_shards_are_whole_batches_and_cover_every_prompt_once():
    batches = [[3, 1], [0, 4, 5], [2]]
    shards = plan_shards(batches, shard_size=3)
    assert [s.batches for s in shards] == [(0, 1), (2,)]
    assert sorted(i for s in shards for i in s.examples) == list(range(6))
    assert [s.batches for s in plan_shards(batches)] == [(0,), (1,), (2,)]
    assert [s.batches for s in plan_shards(batches, one=True)] == [(0, 1, 2)]
    assert batch_cap(64, 64) == 8 and batch_cap(64, 10_000) == 64 and batch_cap(3, 64) == 3
