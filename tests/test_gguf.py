"""A .gguf model path that cannot be read is refused with one line and a code, before anything loads (the real
files are read in tests/test_real_models.py)."""

import pytest

from entoscope.errors import ModelLoadError
from entoscope.models import load_model


def test_a_file_that_is_not_gguf_is_refused_with_a_code(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTOSCOPE_GGUF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)  # the magic, then a header that ends too early
    with pytest.raises(ModelLoadError) as err:
        load_model(str(bad))
    assert err.value.code == "gguf_unreadable" and "\n" not in str(err.value).split("Remedy")[0].strip()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_a_missing_gguf_file_is_refused_with_a_code(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "absent.gguf"))
    assert err.value.code == "folder_missing"


# ---------------------------------------------------------------------- small synthetic .gguf files (tests/gguf_files.py)
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from entoscope.errors import EntoscopeWarning, UnsupportedModelError  # noqa: E402
from entoscope.models.adapter import adapt, module_of  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "src" / "entoscope" / "demo"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("ENTOSCOPE_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model, ids=(0, 5, 9, 30, 7)):
    return adapt(model).run(torch.tensor([list(ids)])).logits[0]


def _source_logits(seed=0, ids=(0, 5, 9, 30, 7)):
    from entoscope.models.tiny import tiny_hf_model

    with torch.no_grad():
        return tiny_hf_model("llama", seed)(torch.tensor([list(ids)])).logits[0]


def test_a_gguf_model_is_named_by_its_general_name_and_reads_the_weights_written(cache, tmp_path):
    """The name is the file's general.name (not the cache folder's path), on every backend; the logits are those of
    the HuggingFace model the file was written from (float32 tensors: exact)."""
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf", name="Tiny Llama Test")
    model = load_model(str(path))
    assert adapt(model).name == "Tiny Llama Test"
    torch.testing.assert_close(_logits(model), _source_logits(), atol=1e-5, rtol=1e-5)
    from entoscope.results.manifest import model_identity

    assert model_identity(adapt(model))["name"] == "Tiny Llama Test"
    pytest.importorskip("nnsight")
    assert adapt(load_model(str(path), backend="nnsight")).name == "Tiny Llama Test"


def test_a_gguf_without_a_name_is_named_by_its_file(cache, tmp_path):
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "unnamed-q8.gguf", name=None)
    assert adapt(load_model(str(path))).name == "unnamed-q8"


def test_a_folder_is_named_by_the_name_its_config_records(tmp_path):
    """A hub name recorded in config.json (`_name_or_path`) names the model; a recorded local path does not (the
    folder's own path does)."""
    for recorded, expect in (("acme/tiny-demo", "acme/tiny-demo"), ("/home/someone/runs/ckpt", None)):
        folder = tmp_path / recorded.replace("/", "_")
        shutil.copytree(DEMO, folder, ignore=shutil.ignore_patterns("dictionaries"))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": recorded}))
        assert adapt(load_model(str(folder))).name == (expect or str(folder))


def test_a_damaged_cache_entry_is_converted_again(cache, tmp_path):
    """model.safetensors of the dequantized folder cut in half: the next load warns, converts the file again, and
    reads the right weights (on main: SafetensorError on every later load)."""
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf")
    load_model(str(path))
    (entry,) = [f for f in cache.iterdir() if f.name.startswith("tiny-")]
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.warns(EntoscopeWarning, match="gguf_cache_rebuilt"):
        model = load_model(str(path))
    torch.testing.assert_close(_logits(model), _source_logits(), atol=1e-5, rtol=1e-5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", EntoscopeWarning)  # intact again: reused without a warning
        load_model(str(path))
    assert sorted(f.name for f in cache.iterdir()) == ["by-sha256", entry.name]


def test_a_damaged_model_folder_is_refused_naming_the_file(tmp_path, capsys):
    """A user's HuggingFace folder whose model.safetensors is truncated: one line, code weights_damaged, naming the
    file (on main: [internal_error] SafetensorError)."""
    from entoscope.cli import main

    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder, ignore=shutil.ignore_patterns("dictionaries"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(folder))
    assert err.value.code == "weights_damaged" and str(weights) in str(err.value)
    capsys.readouterr()
    assert main(["lens", "--model", str(folder), "--data", "{task: ioi, n: 2}", "--plan"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "[weights_damaged]" in lines[0] and "model.safetensors" in lines[0], lines
    # the older format: a truncated pytorch_model.bin (torch's zip reader fails while transformers loads it)
    from safetensors.torch import load_file

    weights.unlink()
    torch.save(load_file(DEMO / "model.safetensors"), folder / "pytorch_model.bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(folder))
    assert err.value.code == "weights_damaged" and "pytorch_model.bin" in str(err.value)


def test_a_gguf_missing_its_block_tensors_is_refused_and_nothing_is_cached(cache, tmp_path):
    """transformers would fill the missing blocks with a random initialisation and only log it: refused, with the
    missing tensors named, and no folder left in the cache to load silently later."""
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "noblocks.gguf", drop=("blk.",))
    for _ in range(2):
        with pytest.raises(ModelLoadError) as err:
            load_model(str(path))
        assert err.value.code == "gguf_tensors_missing" and "model.layers.0" in str(err.value)
    assert not cache.exists() or not [f for f in cache.iterdir() if f.name != "by-sha256"]


def test_a_gguf_already_dequantized_elsewhere_is_not_converted_again(cache, tmp_path, monkeypatch):
    """The folder scripts/fetch_real_models.py makes (dequantized_folder(file, folder)) is the one a later
    load_model(file) reads: no second conversion, no second copy in the GGUF cache."""
    from gguf_files import write_llama_gguf

    from entoscope.models import gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf")
    made = gguf.dequantized_folder(path, tmp_path / "real-models" / "tiny")
    monkeypatch.setattr(gguf, "_read", lambda p: (_ for _ in ()).throw(AssertionError("converted again")))
    model = load_model(str(path))
    assert adapt(model).name == "Tiny Llama Test"
    torch.testing.assert_close(_logits(model), _source_logits(), atol=1e-5, rtol=1e-5)
    assert [f.name for f in cache.iterdir()] == ["by-sha256"]  # only the index: no folder of its own
    assert gguf.dequantized_folder(path) == made.resolve()


def test_a_gguf_of_an_unsupported_architecture_is_refused_naming_it(cache, tmp_path):
    from gguf_files import write_mamba_gguf

    path = write_mamba_gguf(tmp_path / "tiny-mamba.gguf")
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(path))
    assert "'mamba'" in str(err.value) and "tiny-mamba.gguf" in str(err.value)


def test_a_folder_of_gguf_files_without_a_config_points_at_them(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "m"))
    assert err.value.code == "not_a_model_folder" and "model-q4.gguf" in str(err.value)
    assert str(tmp_path / "m" / "model-q4.gguf") in err.value.remedy
