"""The command line never shows a traceback: every mistake a user can type is one line with a code.

Each case runs `entoscope.cli.main` on the case's arguments, in this process (stderr captured, in the
cases' folder), and checks the outcome: exit status 2, exactly one line on stderr of the form
`entoscope: error: [code] ... Remedy: ...`, the expected code, and no traceback. One case per stage a
mistake is caught at (AS_COMMANDS) runs again as a real `entoscope` command in a subprocess (three at a
time, one torch thread each) in the slow set (`-m slow`, CI), where an interpreter-level failure would
show too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import has_hooked_transformer

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ENTOSCOPE_QUIET": "1",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
DEMO = Path(__file__).resolve().parent.parent / "src" / "entoscope" / "demo"


def entoscope(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entoscope.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _folders(root: Path) -> None:
    """Model folders a user might point --model at, each broken in one way."""
    import shutil

    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel, T5Config, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(DEMO))
    (root / "noweights").mkdir()
    (root / "notok").mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, root / "noweights" / f)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(DEMO / f, root / "notok" / f)
    bert = BertLMHeadModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, is_decoder=True))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                             d_kv=16))
    for name, model in (("bert", bert), ("t5", t5)):
        model.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))


def _files(root: Path) -> None:
    lines = {"list.jsonl": "[1, 2]", "number.jsonl": '{"prompt": 5}', "none.jsonl": '{"prompt": null}',
             "nested.jsonl": '{"prompt": [[1, 2], [3]]}', "oov.jsonl": '{"prompt": [1, 99999]}',
             "negative.jsonl": '{"prompt": [1, -3]}', "badjson.jsonl": '{"prompt": "a",'}
    for name, text in lines.items():
        (root / name).write_text(text + "\n")
    (root / "afile").write_text("not a folder")
    (root / "notjson.json").write_text("garbage{")
    (root / "notmanifest.json").write_text('{"a": 1}')
    (root / "future.json").write_text(json.dumps({"operation": "lens", "config": {}, "format_version": 99}))
    (root / "exp.yaml").write_text("a:\n  operation: lens\n  data: {task: ioi, n: 2}\n")
    (root / "badexp.yaml").write_text("a: [1, 2\n")
    (root / "tl").mkdir()
    (root / "tl" / "config.json").write_text('{"num_hidden_layers": 3, "d_model": 128}')
    (root / "tl" / "translators.safetensors").write_bytes(b"\x07" * 64)


IOI = "{task: ioi, n: 4}"
CASES = [  # (id, arguments, expected code)
    ("unknown-task", ["lens", "--data", "iox"], "unknown_task"),
    ("negative-n", ["lens", "--data", "{task: ioi, n: -2}"], "task_param_invalid"),
    ("unknown-task-param", ["lens", "--data", "{task: ioi, n: 4, params: {foo: 1}}"], "task_param_unknown"),
    ("task-param-type", ["lens", "--data", "{task: ioi, n: many}"], "config_invalid"),
    ("names-not-single-tokens", ["lens", "--data", "ioi", "--model", "bert"], "not_a_decoder"),
    ("jsonl-list-line", ["lens", "--data", "list.jsonl"], "data_file_invalid"),
    ("jsonl-bad-json", ["lens", "--data", "badjson.jsonl"], "data_file_invalid"),
    ("prompt-number", ["lens", "--data", "number.jsonl"], "prompt_invalid"),
    ("prompt-none", ["lens", "--data", "none.jsonl"], "data_file_invalid"),
    ("prompt-nested", ["lens", "--data", "nested.jsonl"], "prompt_invalid"),
    ("token-out-of-vocab", ["lens", "--data", "oov.jsonl"], "token_out_of_range"),
    ("token-negative", ["lens", "--data", "negative.jsonl"], "token_out_of_range"),
    ("empty-prompt-no-bos", ["lens", "--data", "{prompts: ['']}", "--prepend-bos", "false"], "empty_prompt"),
    ("device-cuda", ["lens", "--data", IOI, "--device", "cuda"], "device_unavailable"),
    ("device-unknown", ["lens", "--data", IOI, "--device", "tpu9"], "unknown_device"),
    ("folder-without-weights", ["lens", "--data", IOI, "--model", "noweights"], "weights_missing"),
    ("folder-without-tokenizer", ["lens", "--data", IOI, "--model", "notok"], "tokenizer_missing"),
    ("encoder-decoder", ["lens", "--data", IOI, "--model", "t5"], "not_a_decoder"),
    ("missing-folder", ["lens", "--data", IOI, "--model", "./nowhere"], "folder_missing"),
    ("hub-offline", ["info", "--model", "gpt2"], "hub_unreachable"),
    ("positions-before-start", ["lens", "--data", IOI, "--sites",
                                "{activation: resid_post, over: [layer, position], positions: '-200:'}"],
     "site_out_of_range"),
    ("positions-past-end", ["lens", "--data", IOI, "--sites",
                            "{activation: resid_post, over: [layer, position], positions: '-3:40'}"],
     "site_out_of_range"),
    ("layer-out-of-range-plan", ["lens", "--data", IOI, "--plan", "--sites",
                                 "{activation: blocks.9.hook_resid_post, over: [position]}"], "site_out_of_range"),
    ("yaml-boolean-layer", ["lens", "--data", IOI, "--sites", "{activation: resid_post, layers: on}"],
     "config_invalid"),
    ("nan-threshold", ["circuit", "--data", IOI, "--threshold", ".nan"], "config_invalid"),
    ("metric-param", ["patch", "--data", IOI, "--metric", "{type: logit_diff, params: {foo: 1}}"],
     "metric_param_unknown"),
    ("period-too-long", ["head-scores", "--data", "{task: repeated_tokens, n: 2, params: {length: 5}}",
                         "--period", "20"], "period_too_long"),
    ("train-lens-zero-steps", ["train-lens", "--data", IOI, "--steps", "0", "--out", "lensout"], "bad_steps"),
    ("corrupt-translators", ["lens", "--data", IOI, "--method", "tuned", "--translators", "tl"], "tuned_lens_corrupt"),
    ("run-missing-manifest", ["run", "nowhere.json"], "config_file_missing"),
    ("run-invalid-json", ["run", "notjson.json"], "manifest_invalid"),
    ("run-not-a-manifest", ["run", "notmanifest.json"], "manifest_invalid"),
    ("run-newer-manifest", ["run", "future.json"], "manifest_too_new"),
    ("run-bad-yaml", ["run", "badexp.yaml"], "config_not_yaml"),
    ("run-unknown-entry", ["run", "exp.yaml", "b"], "unknown_entry"),
    ("out-under-a-file", ["lens", "--data", IOI, "--out", "afile/sub"], "out_under_a_file"),
    ("unknown-option", ["lens", "--bogus", "3"], "bad_arguments"),
    ("option-needs-a-number", ["info", "--n", "many"], "bad_arguments"),
    ("bad-yaml-value", ["lens", "--data", "{task: ioi", "--plan"], "config_invalid"),
    ("unknown-operation-key", ["lens", "--data", IOI, "--sites", "{activation: resid_post, overr: [layer]}"],
     "config_invalid"),
]
if not has_hooked_transformer():
    CASES.append(("hooked-on-tl4", ["lens", "--data", IOI, "--backend", "hooked"], "hooked_needs_tl3"))


def _cases_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_cases")
    _folders(root)
    _files(root)
    return root


def in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`entoscope.cli.main(args)` run here in `cwd`: its exit status and what it wrote to stderr."""
    from entoscope.cli import main

    err, here = io.StringIO(), Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(list(args))
            except SystemExit as done:  # argparse's --help; never a case here
                code = done.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = _cases_folder(tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENTOSCOPE_QUIET", "1")
        return {name: in_process(args, root) for name, args, _ in CASES}


# The cases run again as real commands: one per stage a mistake can be caught at (argument parsing, YAML,
# data, tokens, device, model folder, hub, sites, plan, manifest, experiment file, output folder, training
# arguments, metric), so an interpreter-level failure at any stage would show; every case runs in-process above.
AS_COMMANDS = {"unknown-option", "bad-yaml-value", "unknown-task", "jsonl-bad-json", "token-out-of-vocab",
               "device-cuda", "missing-folder", "encoder-decoder", "hub-offline", "positions-past-end",
               "layer-out-of-range-plan", "run-invalid-json", "run-unknown-entry", "out-under-a-file",
               "train-lens-zero-steps", "metric-param"}
COMMAND_CASES = [c for c in CASES if c[0] in AS_COMMANDS]


@pytest.fixture(scope="module")
def process_outcomes(tmp_path_factory):
    root = _cases_folder(tmp_path_factory)
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = pool.map(lambda c: entoscope(*c[1], cwd=root), COMMAND_CASES)
        done = dict(zip([c[0] for c in COMMAND_CASES], outcomes))
    return done


@pytest.mark.parametrize("case, args, code", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_with_its_code(outcomes, case, args, code):
    _one_line_with(outcomes[case], code)


@pytest.mark.slow
@pytest.mark.parametrize("case, args, code", COMMAND_CASES, ids=[c[0] for c in COMMAND_CASES])
def test_a_mistake_is_one_line_with_its_code_as_a_command(process_outcomes, case, args, code):
    _one_line_with(process_outcomes[case], code)


def _one_line_with(proc: subprocess.CompletedProcess, code: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in lines if line.startswith("entoscope: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert errors[0].startswith(f"entoscope: error: [{code}] ") and "Remedy: " in errors[0], errors[0]


def test_help_of_every_sub_command_renders():
    from entoscope.cli import build_parser, main

    commands = list(build_parser()._subparsers._group_actions[0].choices)
    assert {"lens", "circuit", "patch", "probe", "run", "report", "train-lens"} <= set(commands)
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0, command


def test_option_placeholders_say_what_they_take(capsys):
    from entoscope.cli import main

    with pytest.raises(SystemExit):
        main(["patch", "--help"])
    text = capsys.readouterr().out
    assert "CFG_" not in text
    assert "--batch-size N" in text and "--min-gap FLOAT" in text and "--per-prompt BOOL" in text
    assert "--method {exact,attribution,integrated_gradients}" in text


def test_version(capsys):
    import importlib.metadata as md

    import entoscope
    from entoscope.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"entoscope {entoscope.__version__} ")
    assert f"transformer-lens {md.version('transformer-lens')}" in out


BEFORE_LOAD = ["unknown-task", "task-param-unknown", "jsonl-bad-json", "metric-param", "unknown-metric",
               "train-lens-unknown-task"]


@pytest.mark.parametrize("case", BEFORE_LOAD)
def test_a_mistake_in_the_data_or_the_metric_is_refused_before_the_model_loads(tmp_path, monkeypatch, case):
    import entoscope.cli as cli
    from entoscope.models import loading

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was refused")

    monkeypatch.setattr(cli, "_load", loads)
    monkeypatch.setattr(loading, "load_model", loads)
    monkeypatch.setenv("ENTOSCOPE_QUIET", "1")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n', encoding="utf-8")
    args, code = {
        "unknown-task": (["lens", "--data", "{task: iox, n: 4}"], "unknown_task"),
        "task-param-unknown": (["lens", "--data", "{task: ioi, n: 4, params: {bogus: 1}}"], "task_param_unknown"),
        "jsonl-bad-json": (["lens", "--data", "bad.jsonl"], "data_file_invalid"),
        "metric-param": (["patch", "--data", IOI, "--metric", "{type: logit_diff, params: {foo: 1}}"],
                         "metric_param_unknown"),
        "unknown-metric": (["patch", "--data", IOI, "--metric", "nosuch"], "unknown_metric"),
        "train-lens-unknown-task": (["train-lens", "--data", "{task: iox}", "--out", "tl"], "unknown_task"),
    }[case]
    _one_line_with(in_process(args, tmp_path), code)


def test_an_unforeseen_exception_is_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    from entoscope import cli

    def boom(args):
        raise ZeroDivisionError("something entoscope did not foresee")

    monkeypatch.setattr(cli, "_info", boom)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("entoscope: error: [internal_error] ZeroDivisionError")
    assert "--debug" in err[0]
    assert cli.main(["info", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_an_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    from entoscope import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_info", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["entoscope: interrupted; nothing was saved"]


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "entoscope.cli", "report", "--model", "demo", "--out",
                             str(tmp_path / "report")], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not list(tmp_path.glob(".report.partial-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)  # wait until the model is loaded and the report is being written
    time.sleep(1.0)
    assert proc.poll() is None, "the report ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "entoscope: interrupted; nothing was saved" and "Traceback" not in err
    assert not (tmp_path / "report").exists()  # the partial report was removed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]
