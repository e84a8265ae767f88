"""No input gives a silent wrong number or a lost run: each case is refused with a code, warned about
and recorded, or gives the right numbers (checked against an independent computation)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import entoscope as es
from entoscope.cli import main
from entoscope.data.examples import Dataset, Example
from entoscope.errors import CheckFailedError, ConfigError, DataError, EntoscopeError, SaveError, SiteError
from entoscope.models import Intervention, adapt
from entoscope.models.tiny import tiny_model

from conftest import has_hooked_transformer


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _ioi(n=4, seed=0):
    return es.tasks.ioi(n=n, seed=seed)


# ---------------------------------------------------------------------- refusals in the Python API
def test_configs_built_in_python_refuse_with_a_config_error():
    with pytest.raises(ConfigError) as err:
        es.Patching(ig_steps=0)
    assert err.value.code == "config_invalid" and "Patching.ig_steps" in str(err.value)
    with pytest.raises(ConfigError, match="Patching.sites.layers"):
        es.Patching(sites={"activation": "resid_pre", "layers": True})  # YAML `on`
    with pytest.raises(ConfigError, match="Sites.coords"):
        es.Sites(activation="z", over=["layer", "head"], coords=[{"layer": True, "head": 0}])
    with pytest.raises(ConfigError, match="Circuits.threshold"):
        es.Circuits(selection="threshold", threshold=float("nan"))  # an empty circuit, silently
    assert es.Sites(activation="resid_pre", layers=[0, 2]).layers == [0, 2]  # numbers still pass


@pytest.mark.parametrize("data, code", [
    ({"task": "iox"}, "unknown_task"), ({"task": "ioi", "n": -2}, "task_param_invalid"),
    ({"task": "ioi", "params": {"foo": 1}}, "task_param_unknown"), ({"task": "ioi", "params": {"length": 3}}, "task_param_unknown"),
    ({"task": "induction", "params": {"length": "ten"}}, "task_param_invalid"),
    ([None], "prompt_invalid"), ([[[1, 2], [3]]], "prompt_invalid"), ([5], "prompt_invalid"),
    ([[1, 99999]], "token_out_of_range"), ([[1, -3]], "token_out_of_range"), (None, "data_missing"),
])
def test_bad_data_is_refused_at_plan_time(demo, data, code):
    with pytest.raises(EntoscopeError) as err:
        es.Lens().plan(demo, data)
    assert err.value.code == code


def test_an_empty_prompt_without_bos_is_refused(demo):
    with pytest.raises(DataError) as err:
        es.Lens(prepend_bos=False).plan(demo, {"prompts": [""]})
    assert err.value.code == "empty_prompt"


@pytest.mark.skipif(has_hooked_transformer(), reason="transformer-lens 3.x has HookedTransformer")
def test_hooked_backend_on_transformer_lens_4_says_what_to_install():
    with pytest.raises(ConfigError) as err:
        es.load_model("demo", backend="hooked")
    assert err.value.code == "hooked_needs_tl3" and "transformer-lens>=3.2,<4" in err.value.remedy


def test_plan_makes_the_checks_run_makes(demo):
    cases = [
        (es.Lens(sites=es.Sites(activation="blocks.9.hook_resid_post", over=["position"])), "site_out_of_range"),
        (es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions="-200:")),
         "site_out_of_range"),
        (es.Patching(metric={"type": "logit_diff", "params": {"foo": 1}}), "metric_param_unknown"),
        (es.HeadScores(period=50), "period_too_long"),
    ]
    for op, code in cases:
        for call in (op.plan, op.run):
            with pytest.raises(EntoscopeError) as err:
                call(demo, _ioi())
            assert err.value.code == code, (op, call)


def test_final_resid_and_negative_layers_with_a_position_axis(demo):
    data = _ioi(n=3)
    tables = [es.Lens(sites=es.Sites(activation=a, over=["position"], positions="-2:")).run(demo, data, quiet=True).table
              for a in ("final_resid", "blocks.-1.hook_resid_post", "resid_post.2")]
    for t in tables[1:]:
        pd.testing.assert_frame_equal(t, tables[0])
    assert len(tables[0]) == 2


def test_negative_positions_never_wrap_into_other_tokens(demo):
    data = es.Dataset("short", (es.Example("When Mary and John went to the store"),
                                es.Example("When Mary and John went to the store, John gave a drink")))
    shortest = min(len(adapt(demo).tokenize(e.prompt)) for e in data)
    ok = es.Sites(activation="resid_post", over=["layer", "position"], positions=f"-{shortest}:")
    es.Lens(sites=ok).plan(demo, data)
    for bad in (f"-{shortest + 1}:", f"0:{shortest + 1}", "2:-1"):
        with pytest.raises(SiteError):
            es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions=bad)).plan(demo, data)


# ---------------------------------------------------------------------- silent wrong numbers
def test_a_model_in_train_mode_runs_in_eval_mode_with_a_recorded_warning():
    model = es.load_model("demo")
    tokens = adapt(model).tokenize("When Mary and John went to the store, John gave a drink to")
    expected = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"])).run(model, _ioi(), quiet=True)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    model.train()
    with torch.no_grad():  # the model itself is random now
        a, b = model(torch.tensor([tokens])), model(torch.tensor([tokens]))
    assert not torch.equal(a, b)
    op = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"]))
    with pytest.warns(es.errors.EntoscopeWarning, match="train mode"):
        runs = [op.run(model, _ioi(), quiet=True) for _ in range(2)]
    for r in runs:
        pd.testing.assert_frame_equal(r.table, expected.table)
        # (4 prompts cannot make any of the cells a discovery: screen_blind, said before the run)
        assert [w["code"] for w in r.warnings] == ["screen_blind", "train_mode_switched"]
        assert r.manifest["warnings"] == r.warnings
    assert model.training and all(m.training for m in model.modules())  # put back as it was


def test_nan_in_a_weight_is_refused_naming_it():
    model = es.load_model("demo")
    with torch.no_grad():
        model.blocks[1].mlp.parameters().__next__()[0, 0] = float("nan")
    with pytest.raises(CheckFailedError) as err:
        es.Lens().run(model, _ioi(), quiet=True)
    assert err.value.code == "non_finite_weights" and "h.1.mlp" in err.value.message


def test_nan_in_an_activation_names_the_first_hook_where_it_appears(demo):
    a = adapt(demo)
    tokens = torch.tensor([a.tokenize("When Mary and John went")])
    poison = Intervention("resid_mid.1", lambda x: x.index_fill(-1, torch.tensor([0]), float("nan")))
    with pytest.raises(CheckFailedError) as err:
        a.run(tokens, ["resid_post.2"], interventions=[poison])
    assert err.value.code == "non_finite" and "first appears at resid_mid.1 (hook blocks.1." in err.value.message
    with pytest.raises(CheckFailedError, match="non_finite|NaN"):  # a patch value that makes inf
        es.Patching(patch="scaled", patch_params={"factor": float("inf")}, direction="noising",
                    comparison="difference", sites=es.Sites(activation="resid_pre", over=["layer"])
                    ).run(demo, _ioi(), quiet=True)


def test_a_metric_that_is_nan_or_raises_is_refused_with_where_it_ran(demo):
    @es.register("metric", "nan_metric", replace=True)
    def nan_metric(logits, answers, wrong, reference=None):  # fine on all-zero logits, NaN on a real run
        return torch.where(logits[:, 0] == 0, 0.0, float("nan"))

    @es.register("metric", "broken_metric", replace=True)
    def broken_metric(logits, answers, wrong, reference=None):
        if logits.shape[0] > 1:
            raise RuntimeError("my bug")
        return logits[:, 0]

    with pytest.raises(CheckFailedError) as err:
        es.Patching(metric="nan_metric").run(demo, _ioi(), quiet=True)
    assert err.value.code == "metric_non_finite" and "batch 1" in err.value.message
    with pytest.raises(es.errors.MetricError) as err:
        es.Patching(metric="broken_metric", sites=es.Sites(activation="resid_pre", over=["layer"])
                    ).run(demo, _ioi(), quiet=True)
    assert err.value.code == "metric_failed" and "broken_metric" in err.value.message
    assert "examples" in err.value.message and isinstance(err.value.__cause__, RuntimeError)


def test_dla_identity_check_fails_on_nan():
    dla = es.DirectLogitAttribution()
    ident = {"sum": torch.tensor([1.0, float("nan")]), "constant": torch.tensor([0.0, 0.0]),
             "value": torch.tensor([1.0, 1.0])}
    with pytest.raises(CheckFailedError) as err:
        dla._check(ident, 1e-4)
    assert err.value.code == "dla_identity_failed"


def test_head_scores_leave_out_prompts_without_targets(demo):
    a = adapt(demo)
    rep = es.tasks.repeated_tokens(n=1, seed=0, length=6, bos_token_id=a.bos_token_id)
    plain = Example(tuple(range(10, 22)))  # twelve distinct tokens: no duplicate anywhere
    both = Dataset("mixed", (rep[0], plain))
    op = es.HeadScores(kinds=["duplicate_token"])
    with pytest.warns(es.errors.EntoscopeWarning, match="no target"):
        mixed = op.run(demo, both, quiet=True).table
    alone = op.run(demo, Dataset("rep", (rep[0],)), quiet=True).table
    np.testing.assert_allclose(mixed["score"], alone["score"], atol=1e-6)  # not halved by the plain prompt
    assert (mixed["n_prompts"] == 1).all()
    with pytest.raises(DataError) as err:
        op.run(demo, Dataset("plain", (plain,)), quiet=True)
    assert err.value.code == "no_targets"


def test_folders_that_would_load_wrongly_are_refused(tmp_path):
    import shutil

    demo_dir = Path(es.models.loading.DEMO_DIR)
    (tmp_path / "notok").mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(demo_dir / f, tmp_path / "notok" / f)
    with pytest.raises(es.errors.ModelLoadError) as err:
        es.load_model(str(tmp_path / "notok"))
    assert err.value.code == "tokenizer_missing"
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    bert = BertLMHeadModel(BertConfig(vocab_size=1317, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, is_decoder=True))
    bert.save_pretrained(str(tmp_path / "bert"))
    AutoTokenizer.from_pretrained(str(demo_dir)).save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(es.errors.UnsupportedModelError) as err:
        es.load_model(str(tmp_path / "bert"))
    assert err.value.code == "not_a_decoder"


# ---------------------------------------------------------------------- manifests
def _saved_lens_run(model, folder):
    data = ["When Mary and John went to the store", "one two three four five"]
    result = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(model, data, quiet=True)
    result.save(folder)
    return result


def test_rerunning_a_manifest_compares_and_saves_beside(tmp_path, capsys, demo):
    _saved_lens_run(demo, tmp_path / "run")
    assert main(["run", str(tmp_path / "run" / "manifest.json"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "max |difference| 0 " in out and (tmp_path / "run-rerun-1" / "manifest.json").exists()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "table.parquet"),
                                  pd.read_parquet(tmp_path / "run-rerun-1" / "table.parquet"))


def test_a_manifest_of_a_model_built_in_python_needs_a_model(tmp_path, capsys):
    _saved_lens_run(tiny_model("gpt2"), tmp_path / "run")
    assert main(["run", str(tmp_path / "run")]) == 2
    assert "[manifest_no_model_source]" in capsys.readouterr().err


def test_a_changed_model_folder_is_refused_then_allowed(tmp_path, capsys):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(es.models.loading.DEMO_DIR, folder)
    _saved_lens_run(es.load_model(str(folder)), tmp_path / "run")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    key = next(k for k in weights if "h.0.mlp.c_fc.weight" in k)
    weights[key] = weights[key] * 1.5
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert main(["run", str(tmp_path / "run" / "manifest.json")]) == 2
    assert "[model_changed]" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "run" / "manifest.json"), "--allow-model-change", "--quiet"]) == 0
    out = capsys.readouterr().out
    diff = float(out.split("max |difference| ")[1].split()[0])
    assert diff > 1e-3  # the new weights give other numbers, and the comparison says so
    manifest = json.loads((tmp_path / "run-rerun-1" / "manifest.json").read_text())
    assert [w["code"] for w in manifest["warnings"]] == ["model_changed"]


# ---------------------------------------------------------------------- lost or mixed runs
def test_a_run_is_never_replaced_unless_asked_and_never_mixed(tmp_path, demo):
    patching = es.Patching(sites=es.Sites(activation="resid_pre", over=["layer"])).run(demo, _ioi(), quiet=True)
    patching.save(tmp_path / "d")
    assert (tmp_path / "d" / "per_prompt.csv").exists()
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(demo, _ioi(), quiet=True)
    lens.per_prompt = None
    with pytest.raises(SaveError) as err:
        lens.save(tmp_path / "d")
    assert err.value.code == "run_exists"
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["operation"] == "patching"
    lens.save(tmp_path / "d", overwrite=True)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["operation"] == "lens" and sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(
        manifest["files"])  # nothing of the patching run is left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my own file")
    with pytest.raises(SaveError) as err:
        lens.save(tmp_path / "mine", overwrite=True)
    assert err.value.code == "out_not_empty" and (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.parametrize("failure", ["interrupt", "disk_full"])
def test_a_failed_save_leaves_the_previous_run_untouched(tmp_path, demo, monkeypatch, failure):
    first = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).run(demo, _ioi(), quiet=True)
    first.save(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    second = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"], positions="-2:")
                     ).run(demo, _ioi(), quiet=True)

    def fail(*args, **kwargs):
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", fail)
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else SaveError) as err:
        second.save(tmp_path / "run", overwrite=True)
    if failure == "disk_full":
        assert err.value.code == "save_failed" and "No space left" in err.value.message
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial folder left behind


@pytest.mark.slow
def test_four_processes_save_sibling_runs_under_one_new_parent(tmp_path):
    script = (
        "import sys, pandas as pd\n"
        "from entoscope.results.result import Result\n"
        "Result('x', pd.DataFrame({'a': [int(sys.argv[2])]})).save(sys.argv[1])\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "new" / f"run{i}"), str(i)], env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errs
    for i in range(4):
        run = tmp_path / "new" / f"run{i}"
        assert pd.read_csv(run / "table.csv")["a"].tolist() == [i]
        assert (run / "plotly.min.js").stat().st_size > 1_000_000
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [f"run{i}" for i in range(4)]


def test_an_interrupted_report_leaves_the_older_report_whole(tmp_path, demo, monkeypatch):
    from entoscope import registry
    from entoscope.report import build_report

    page = build_report(demo, tmp_path / "report", quick=True, sections=["lens"])
    before = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in (tmp_path / "report").rglob("*") if p.is_file()}

    def interrupting(model, folder, quick):
        raise KeyboardInterrupt

    monkeypatch.setitem(registry._REGISTRY["report_section"], "interrupting", interrupting)  # gone after the test

    with pytest.raises(KeyboardInterrupt):
        build_report(demo, tmp_path / "report", quick=True, sections=["lens", "interrupting"], overwrite=True)
    after = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in (tmp_path / "report").rglob("*") if p.is_file()}
    assert after == before and page.exists()
    # the interrupted report's finished steps are kept apart, hidden, for the next report (report/resume.py)
    [kept] = [p for p in tmp_path.iterdir() if p.name != "report"]
    assert kept.name.startswith(".report.partial-") and (kept / "lens" / "table.csv").is_file()
    with pytest.raises(SaveError):
        build_report(demo, tmp_path / "report", quick=True, sections=["lens"])  # replaced only when asked
