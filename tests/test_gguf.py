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
