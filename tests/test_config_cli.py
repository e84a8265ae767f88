"""One run, three spellings (Python, YAML, CLI) give identical tables; a saved manifest re-runs to
an identical table; bad configs are refused with the path of the key."""

import json
import re
import shutil

import pandas as pd
import pytest

import entoscope as es
from entoscope.cli import main
from entoscope.config import build_operation, load_experiments
from entoscope.errors import ConfigError

YAML = """
lens_ioi:
  operation: lens
  sites: {activation: resid_post, over: [layer, position], positions: "-3:"}
  top_k: 3
  data: {task: ioi, n: 4, seed: 5}
"""


def _python_table():
    op = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions="-3:"), top_k=3)
    return op.run(es.load_model("demo"), {"task": "ioi", "n": 4, "seed": 5}, quiet=True).table


def test_python_yaml_and_cli_give_identical_tables(tmp_path):
    py = _python_table()
    (tmp_path / "exp.yaml").write_text(YAML)
    op, spec = build_operation(load_experiments(tmp_path / "exp.yaml")["lens_ioi"], "lens_ioi")
    yml = op.run(es.load_model("demo"), spec, quiet=True).table
    pd.testing.assert_frame_equal(py, yml)
    assert main(["run", str(tmp_path / "exp.yaml"), "lens_ioi", "--model", "demo", "--out", str(tmp_path / "runs"),
                 "--quiet"]) == 0
    from_yaml_cli = pd.read_csv(tmp_path / "runs" / "lens_ioi" / "table.csv")
    assert main(["lens", "--model", "demo", "--data", "{task: ioi, n: 4, seed: 5}", "--top-k", "3",
                 "--sites", "{activation: resid_post, over: [layer, position], positions: '-3:'}",
                 "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    from_cli = pd.read_csv(tmp_path / "cli" / "table.csv")
    pd.testing.assert_frame_equal(from_yaml_cli, from_cli)
    pd.testing.assert_frame_equal(from_cli, pd.read_csv(_csv(py, tmp_path)))


def _csv(frame, tmp_path):
    path = tmp_path / "py.csv"
    frame.to_csv(path, index=False)
    return path


def test_saved_manifest_reruns_to_an_identical_table(tmp_path):
    op = es.Lens(sites=es.Sites(activation="resid_pre", over=["layer"]), top_k=2)
    result = op.run(es.load_model("demo"), es.tasks.facts(n=3, seed=2), quiet=True)
    folder = result.save(tmp_path / "runs" / "facts")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["config"]["top_k"] == 2 and manifest["model"]["source"]["name"] == "demo"
    assert manifest["model"]["structure"]["n_layers"] == 3 and len(manifest["data"]["records"]) == 3
    assert {"csv", "parquet", "html"} <= {f.split(".")[-1] for f in manifest["files"]}
    assert main(["run", str(folder / "manifest.json"), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(folder / "table.csv"), pd.read_csv(tmp_path / "again" / "table.csv"))
    pd.testing.assert_frame_equal(pd.read_parquet(folder / "table.parquet"), result.table)


def test_saved_run_folders_are_self_contained_and_pages_stay_small(tmp_path):
    op = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]))
    op.run(es.load_model("demo"), "When Mary and John went to the store", quiet=True).save(tmp_path / "a")
    moved = shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "copy")  # a copied run still shows its plots
    page = (moved / "index.html").read_text()
    src = re.search(r'<script src="([^"]+)">', page).group(1)
    assert (moved / src).resolve().stat().st_size > 1_000_000 and (moved / src).resolve().parent == moved.resolve()
    assert len(page) < 300_000 and not (tmp_path / "plotly.min.js").exists()


@pytest.mark.parametrize("entry, where", [
    ({"operation": "lens", "top_kk": 3}, "e.top_kk: unknown key"),
    ({"operation": "lens", "sites": {"over": ["layer"]}}, "e.sites.activation: missing key"),
    ({"operation": "lens", "top_k": "many"}, "e.top_k:"),
    ({"operation": "lens", "sites": {"activation": "resid_pre", "over": "layer"}}, "e.sites.over:"),
    ({"operation": "lenz"}, "e.operation:"),
    ({"operation": "lens", "data": {"task": "ioi", "nn": 3}}, "e.data.nn: unknown key"),
])
def test_bad_configs_point_at_the_key(entry, where):
    with pytest.raises(ConfigError) as err:
        build_operation(entry, "e")
    assert where in str(err.value)


def test_unset_environment_variables_are_refused(tmp_path, monkeypatch):
    (tmp_path / "e.yaml").write_text("x:\n  operation: lens\n  data: {path: '${NO_SUCH_VAR_XYZ}'}\n")
    monkeypatch.delenv("NO_SUCH_VAR_XYZ", raising=False)
    with pytest.raises(ConfigError) as err:
        load_experiments(tmp_path / "e.yaml")
    assert err.value.code == "env_unset" and "x.data.path" in str(err.value)
    monkeypatch.setenv("N_PROMPTS", "7")
    (tmp_path / "f.yaml").write_text("x:\n  operation: lens\n  data: {task: ioi, n: '${N_PROMPTS}'}\n")
    assert load_experiments(tmp_path / "f.yaml")["x"]["data"]["n"] == 7


def test_plan_validates_without_running_and_matches_run(tmp_path):
    demo = es.load_model("demo")
    op = es.Lens(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions=[-1, -2]),
                 batch_size=3)
    data = es.tasks.ioi(n=7, seed=0)
    plan = op.plan(demo, data)
    assert plan.rows == 3 * 2 and plan.forward_passes == 7 and plan.batch_sizes == [3, 3, 1]
    result = op.run(demo, data, quiet=True)
    assert len(result.table) == plan.rows and len(result.per_prompt) == plan.rows * 7
    with pytest.raises(Exception) as err:
        es.Lens(sites=es.Sites(activation="resid_pre", layers=[9])).plan(demo, data)
    assert getattr(err.value, "code", None) == "site_out_of_range"


def test_cli_errors_are_one_clear_line(capsys):
    assert main(["lens", "--model", "demo", "--data", "ioi", "--sites", "{activation: resid_pre, layers: [9]}"]) == 2
    err = capsys.readouterr().err
    assert "site_out_of_range" in err and "Traceback" not in err


def test_a_user_metric_registered_in_python_works_from_yaml():
    import torch

    @es.register("metric", "answer_logit_twice", replace=True)
    def answer_logit_twice(logits, answers, wrong, reference=None):
        return 2 * logits.gather(-1, answers[:, :1])[:, 0]

    m = es.Metric(type="answer_logit_twice")
    logits = torch.randn(3, 10)
    answers = torch.tensor([[1], [2], [3]])
    assert torch.equal(m(logits, answers, answers), 2 * logits[torch.arange(3), answers[:, 0]])
    assert es.Metric.model_validate("answer_logit_twice").type == "answer_logit_twice"
