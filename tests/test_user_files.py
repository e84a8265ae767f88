"""Every file a user hands over is read behind a check, and every argument is checked before work.

Each case damages a real file the way a disk, a copy or a hand edit does (truncated, bytes flipped, a
field removed or retyped, NaN written into the weights) and checks the outcome: one line on the command
line with the expected code naming the file (exit 2), or the same code from Python; nothing at the
destination replaced. The reference for "before work" is that the model is never loaded: the checks
run with a loader that fails the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import entoscope as es
from entoscope import files
from entoscope.cli import main
from entoscope.models.dictionaries.catalog import DEMO, get_dictionary
from entoscope.errors import EntoscopeError
from entoscope.lens import TunedLens
from entoscope.stats.config import Stats


def _one_line(capsys, code: str, *must: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [e for e in err if e.startswith("entoscope: error:")]
    assert len(lines) == 1 and len(err) == 1, err
    assert f"[{code}]" in lines[0] and "Traceback" not in lines[0], lines[0]
    for text in must:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything loads a model: the checks must come first."""
    from entoscope import cli

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(cli, "_load", refuse)


# ---------------------------------------------------------------------- manifests edited by hand
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("manifest") / "run"
    assert main(["lens", "--data", "{task: ioi, n: 4}", "--sites", "{activation: resid_post, over: [layer]}",
                 "--out", str(out), "--quiet"]) == 0
    return out


def _edit(m: dict, how: str) -> dict | str:
    if how == "data without records":
        del m["data"]["records"]
    elif how == "records not a list":
        m["data"]["records"] = "prompts"
    elif how == "a record without prompt":
        del m["data"]["records"][1]["prompt"]
    elif how == "a record's prompt a number":
        m["data"]["records"][2]["prompt"] = 5
    elif how == "a record's meta a list":
        m["data"]["records"][0]["meta"] = [1, 2]
    elif how == "a record removed":
        del m["data"]["records"][3]
    elif how == "source without backend":
        del m["model"]["source"]["backend"]
    elif how == "config a list":
        m["config"] = [1]
    elif how == "fingerprint a number":
        m["model"]["fingerprint"] = 7
    return m


@pytest.mark.parametrize("how, says", [
    ("data without records", "data.records"), ("records not a list", "data.records"),
    ("a record without prompt", "data.records[1]"), ("a record's prompt a number", "example 2"),
    ("a record's meta a list", "data.records"), ("a record removed", "data.n is 4"),
    ("source without backend", "model.source"), ("config a list", "config"),
    ("fingerprint a number", "model.fingerprint"),
])
def test_a_hand_edited_manifest_is_refused_naming_the_file_and_the_field(saved_run, tmp_path, capsys, no_model,
                                                                          how, says):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(_edit(manifest, how)))
    capsys.readouterr()
    assert main(["run", str(run / "manifest.json"), "--out", str(tmp_path / "again")]) == 2
    _one_line(capsys, "manifest_invalid", str(run / "manifest.json"), says)
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("how", ["truncated", "binary"])
def test_a_truncated_or_binary_manifest_is_refused(saved_run, tmp_path, capsys, no_model, how):
    path = tmp_path / "manifest.json"
    text = (saved_run / "manifest.json").read_bytes()
    path.write_bytes(text[: len(text) // 2] if how == "truncated" else b"\xff\xfe\x00garbage")
    capsys.readouterr()
    assert main(["run", str(path)]) == 2
    _one_line(capsys, "manifest_invalid", str(path))


# ---------------------------------------------------------------------- YAML experiment files
@pytest.mark.parametrize("text, code", [
    (b"entry:\n  operation: lens\n  data: {task: ioi, n: 4\n", "config_not_yaml"),  # truncated mid-mapping
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff", "config_not_yaml"),  # not text
    (b"- operation: lens\n", "config_shape"),  # edited into a list
    (b"entry:\n  operation: lens\n  sites: {activation: resid_post, over: [layer, 3]}\n", "config_invalid"),
])
def test_a_truncated_binary_or_misshapen_yaml_file_is_refused(tmp_path, capsys, no_model, text, code):
    path = tmp_path / "exp.yaml"
    path.write_bytes(text)
    capsys.readouterr()
    assert main(["run", str(path)]) == 2
    _one_line(capsys, code)


# ---------------------------------------------------------------------- dictionaries
def _dictionary(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / "sae"
    shutil.copytree(DEMO / "resid_post.1", folder)
    weights_path, cfg_path = folder / "sae_weights.safetensors", folder / "cfg.json"
    w, cfg = load_file(str(weights_path)), json.loads(cfg_path.read_text())
    if how == "truncated weights":
        weights_path.write_bytes(weights_path.read_bytes()[: weights_path.stat().st_size * 2 // 3])
    elif how == "a flipped header byte":
        data = bytearray(weights_path.read_bytes())
        data[8] ^= 0x55  # the header's opening brace
        weights_path.write_bytes(bytes(data))
    elif how in ("NaN in W_dec", "integer W_enc", "W_enc a vector", "b_dec too short"):
        if how == "NaN in W_dec":
            w["W_dec"][3, 5] = float("nan")
        elif how == "integer W_enc":
            w["W_enc"] = w["W_enc"].to(torch.int32)
        elif how == "W_enc a vector":
            w["W_enc"] = w["W_enc"].flatten()
        else:
            w["b_dec"] = w["b_dec"][:-1].clone()
        save_file(w, str(weights_path))
    elif how == "cfg not JSON":
        cfg_path.write_text('{"architecture": "topk", ')
    elif how == "cfg a list":
        cfg_path.write_text("[1, 2]")
    elif how == "d_sae as text":
        cfg["d_sae"] = "many"
        cfg_path.write_text(json.dumps(cfg))
    elif how == "d_sae disagrees":
        cfg["d_sae"] = cfg["d_sae"] + 1
        cfg_path.write_text(json.dumps(cfg))
    elif how == "metadata a list":
        cfg["metadata"] = [1]
        cfg_path.write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("how, code, says", [
    ("truncated weights", "dictionary_corrupt", "sae_weights.safetensors"),
    ("a flipped header byte", "dictionary_corrupt", "sae_weights.safetensors"),
    ("NaN in W_dec", "dictionary_corrupt", "NaN"),
    ("integer W_enc", "dictionary_corrupt", "int32"),
    ("W_enc a vector", "dictionary_shape_mismatch", "W_enc"),
    ("b_dec too short", "dictionary_shape_mismatch", "b_dec"),
    ("cfg not JSON", "dictionary_format_invalid", "cfg.json"),
    ("cfg a list", "dictionary_format_invalid", "cfg.json"),
    ("d_sae as text", "dictionary_format_invalid", "d_sae"),
    ("d_sae disagrees", "dictionary_shape_mismatch", "d_sae"),
    ("metadata a list", "dictionary_format_invalid", "cfg.json"),
])
def test_a_damaged_dictionary_folder_is_refused_naming_the_file(tmp_path, how, code, says):
    folder = _dictionary(tmp_path, how)
    with pytest.raises(EntoscopeError) as err:
        get_dictionary(str(folder))
    assert err.value.code == code and str(folder) in err.value.message and says in err.value.message


def test_a_truncated_dictionary_is_one_line_on_the_command_line(tmp_path, capsys):
    folder = _dictionary(tmp_path, "truncated weights")
    capsys.readouterr()
    sites = "{activation: features, layers: [1], over: [layer], dictionary: %s}" % folder
    assert main(["patch", "--data", "{task: ioi, n: 2}", "--sites", sites, "--quiet"]) == 2
    _one_line(capsys, "dictionary_corrupt", str(folder / "sae_weights.safetensors"))


# ---------------------------------------------------------------------- tuned-lens folders
@pytest.fixture(scope="module")
def lens_folder(tmp_path_factory):
    return TunedLens(3, 128).save(tmp_path_factory.mktemp("lens") / "lens")


@pytest.mark.parametrize("how, says", [
    ("d_model edited to a huge width", "do not fit"), ("num_hidden_layers as text", "whole numbers"),
    ("truncated translators", "translators.safetensors"), ("NaN in a translator", "NaN"),
    ("a layer removed from the config", "do not fit"), ("config not JSON", "config.json"),
])
def test_a_damaged_tuned_lens_folder_is_refused_before_anything_is_built(lens_folder, tmp_path, monkeypatch, how,
                                                                          says):
    folder = tmp_path / "lens"
    shutil.copytree(lens_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    weights = folder / "translators.safetensors"
    if how == "d_model edited to a huge width":
        cfg["d_model"] = 10**7  # 10^14 weights per translator if built from the config
    elif how == "num_hidden_layers as text":
        cfg["num_hidden_layers"] = "3"
    elif how == "a layer removed from the config":
        cfg["num_hidden_layers"] = 2
    elif how == "truncated translators":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "NaN in a translator":
        state = load_file(str(weights))
        state["1.weight"][0, 0] = float("inf")
        save_file(state, str(weights))
    (folder / "config.json").write_text(json.dumps(cfg) if how != "config not JSON" else '{"d_model": 12')
    built = []
    monkeypatch.setattr(torch.nn.Linear, "__init__", lambda self, *a, **k: built.append(a) or
                        (_ for _ in ()).throw(AssertionError("a translator was built")))
    with pytest.raises(EntoscopeError) as err:
        TunedLens.load(folder)
    assert err.value.code == "tuned_lens_corrupt" and says in err.value.message and not built


# ---------------------------------------------------------------------- tensor files (directions)
def test_the_shared_reader_refuses_damaged_tensor_files_and_reads_sound_ones(tmp_path):
    good = {"direction": torch.randn(128), "other": torch.randn(2, 3)}
    save_file(good, str(tmp_path / "d.safetensors"))
    np.save(tmp_path / "d.npy", good["direction"].numpy())
    torch.testing.assert_close(files.read_array(tmp_path / "d.safetensors", "direction"), good["direction"])
    torch.testing.assert_close(files.read_array(tmp_path / "d.npy"), good["direction"])
    raw = (tmp_path / "d.safetensors").read_bytes()
    cases = {
        "missing.npy": None, "empty.npy": b"", "cut.safetensors": raw[: len(raw) - 7],
        "cut.npy": (tmp_path / "d.npy").read_bytes()[:-9], "text.npy": b"not an array",
        "direction.txt": b"1 2 3",
    }
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        with pytest.raises(EntoscopeError) as err:
            files.read_array(tmp_path / name)
        assert err.value.code == "tensor_file_invalid" and name in err.value.message
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))
    np.save(tmp_path / "nan.npy", np.array([1.0, np.nan, np.inf]))
    np.save(tmp_path / "ints.npy", np.arange(3))
    for name, says in (("objects.npy", "objects"), ("nan.npy", "2 NaN"), ("ints.npy", "int64")):
        with pytest.raises(EntoscopeError) as err:
            files.read_array(tmp_path / name)
        assert err.value.code == "tensor_file_invalid" and says in err.value.message
    with pytest.raises(EntoscopeError, match="name the one"):
        files.read_array(tmp_path / "d.safetensors")  # two tensors, none named
    with pytest.raises(EntoscopeError, match="no tensor 'x'"):
        files.read_array(tmp_path / "d.safetensors", "x")


def test_saved_probe_directions_are_read_behind_the_check(tmp_path):
    from entoscope.probing import load_directions

    (tmp_path / "p.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(EntoscopeError) as err:
        load_directions(tmp_path / "p.safetensors")
    assert err.value.code == "tensor_file_invalid" and "p.safetensors" in err.value.message


# ---------------------------------------------------------------------- train-sae and train-lens arguments
SAE = ["train-sae", "--site", "resid_post.1"]


@pytest.mark.parametrize("extra, code, says", [
    (["--lr", "nan"], "train_config_invalid", "lr"), (["--lr", "-1"], "train_config_invalid", "lr"),
    (["--threads", "0"], "bad_arguments", "--threads"), (["--n", "0"], "bad_arguments", "--n"),
    (["--l1", "-0.5", "--architecture", "standard"], "train_config_invalid", "negative penalty"),
    (["--k", "0"], "train_config_invalid", "k"), (["--d-sae", "0"], "train_config_invalid", "d_sae"),
    (["--steps", "0"], "train_config_invalid", "steps"), (["--seed", "-1"], "train_config_invalid", "seed"),
    (["--data-seed", "-1"], "bad_arguments", "--data-seed"),
    (["--site", "pattern.1"], "dictionary_site_unsupported", "pattern.1"),
    (["--site", "logits"], "dictionary_site_unsupported", "logits"),
    (["--site", "embed"], "dictionary_site_unsupported", "embed"),
    (["--site", "mlp_in.1", "--target", "mlp_out.0"], "train_config_invalid", "before"),
    (["--site", "mlp_out.1", "--target", "mlp_in.1"], "train_config_invalid", "before"),
    (["--site", "resid_psot.1"], "unknown_activation", "resid_psot"),
])
def test_train_sae_refuses_bad_arguments_before_the_model_loads(tmp_path, capsys, no_model, extra, code, says):
    capsys.readouterr()
    assert main([*SAE, "--out", str(tmp_path / "sae"), *extra]) == 2
    _one_line(capsys, code, says)
    assert not (tmp_path / "sae").exists()


def test_train_sae_out_onto_a_file_a_folder_of_something_else_or_a_dictionary(tmp_path, capsys, no_model):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    shutil.copytree(DEMO / "resid_post.1", tmp_path / "sae")
    before = (tmp_path / "sae" / "sae_weights.safetensors").read_bytes()
    for out, code in ((tmp_path / "afile", "out_is_a_file"), (tmp_path / "afile" / "x", "out_under_a_file"),
                      (tmp_path / "notes", "out_not_empty"), (tmp_path / "sae", "dictionary_exists")):
        capsys.readouterr()
        assert main([*SAE, "--out", str(out)]) == 2
        _one_line(capsys, code, str(out))
    capsys.readouterr()
    assert main([*SAE, "--out", str(tmp_path / "notes"), "--overwrite"]) == 2  # never replaced: not a dictionary
    _one_line(capsys, "out_not_empty")
    assert (tmp_path / "sae" / "sae_weights.safetensors").read_bytes() == before
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


def test_train_sae_overwrite_replaces_a_dictionary_whole(tmp_path, capsys):
    out = tmp_path / "sae"
    shutil.copytree(DEMO / "resid_post.1", out)
    (out / "stale.txt").write_text("from the old dictionary")
    args = [*SAE, "--out", str(out), "--overwrite", "--d-sae", "16", "--k", "2", "--steps", "3",
            "--batch-tokens", "32", "--data", "{task: ioi, n: 4}"]
    assert main(args) == 0
    d = get_dictionary(str(out))
    assert d.d_sae == 16 and d.hook_out == "resid_post.1" and not (out / "stale.txt").exists()
    assert json.loads((out / "training_report.json").read_text())["config"]["steps"] == 3


def test_train_lens_refuses_to_replace_a_lens_or_a_model_folder(tmp_path, capsys, lens_folder, no_model):
    shutil.copytree(lens_folder, tmp_path / "lens")
    shutil.copytree(DEMO.parent, tmp_path / "model", ignore=shutil.ignore_patterns("dictionaries"))
    for out, extra, code in ((tmp_path / "lens", [], "lens_exists"), (tmp_path / "model", ["--overwrite"],
                                                                     "out_not_empty")):
        capsys.readouterr()
        assert main(["train-lens", "--data", "ioi", "--steps", "1", "--out", str(out), *extra]) == 2
        _one_line(capsys, code, str(out))
    assert (tmp_path / "model" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["train-lens", "--data", "ioi", "--steps", "1", "--lr", "inf", "--out", str(tmp_path / "x")]) == 2
    _one_line(capsys, "bad_lr")


# ---------------------------------------------------------------------- statistics settings
def test_statistics_settings_are_refused_or_warned_with_what_the_interval_means(capsys, no_model):
    for level in (0.9, 0.95, 0.99):
        smallest = next(b for b in range(1, 10**4) if b * (1 - level) / 2 >= 1 - 1e-9)  # one resample per tail
        Stats(n_boot=smallest, ci_level=level)
        with pytest.raises(EntoscopeError) as err:
            Stats(n_boot=smallest - 1, ci_level=level)
        assert err.value.code == "config_invalid" and f"n_boot >= {smallest}" in err.value.message
    assert Stats(n_boot=0).rough_intervals() == "" and Stats(n_boot=1000).rough_intervals() == ""
    assert "rests on 1.25 resample" in Stats(n_boot=50).rough_intervals()
    for extra, says in ((["--stats", "{n_boot: 1}"], "zero width"), (["--seed", "-1"], "seed"),
                        (["--stats", "{ci_level: 1.5}"], "ci_level"), (["--stats", "{ci_level: 0}"], "ci_level")):
        capsys.readouterr()
        assert main(["lens", "--data", "ioi", *extra]) == 2
        _one_line(capsys, "config_invalid", says)


def test_few_resamples_are_warned_and_recorded():
    result = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"]), stats={"n_boot": 50}).run(
        es.load_model("demo"), {"task": "ioi", "n": 4}, quiet=True)
    assert [w["code"] for w in result.warnings] == ["few_resamples"]
    assert result.manifest["warnings"] == result.warnings
