"""GGUF files: a quantized checkpoint read by transformers (the `gguf` package) and dequantized to an ordinary
HuggingFace folder, which every backend then loads like any other.

transformers marks a model read with `gguf_file=` as GGUF-quantized (`save_pretrained` refuses it); its state dict
in a fresh model of the same class, built from the config less `quantization_config`, is an ordinary model with the
same logits. The folder keeps a record (`entoscope_gguf.json`: the file, its SHA-256, the quantization type) that
the structure record and the manifest carry, and the pages say the weights are dequantized.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

RECORD = "entoscope_gguf.json"


def is_gguf(name: str) -> bool:
    return str(name).lower().endswith(".gguf")


def gguf_cache() -> Path:
    return Path(os.environ.get("ENTOSCOPE_GGUF_CACHE") or Path.home() / ".cache" / "entoscope" / "gguf")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def quantization_of(path: Path) -> str:
    """The file's quantization type as llama.cpp names it (general.file_type: Q4_1, Q4_K_M, ...), read from its
    header; the most common tensor type where the header has none."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        try:
            return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "unknown"


def read_record(folder: Path) -> dict[str, Any] | None:
    """The GGUF record of a dequantized folder (None for an ordinary one)."""
    try:
        return json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def dequantized_folder(path: str | Path, folder: str | Path | None = None) -> Path:
    """A HuggingFace folder holding `path`'s weights dequantized to float32 (made once; kept while its record names
    the same SHA-256). `folder` defaults to the GGUF cache (ENTOSCOPE_GGUF_CACHE or ~/.cache/entoscope/gguf)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}", code="folder_missing", remedy="check the path")
    digest = sha256_of(path)
    folder = Path(folder) if folder is not None else gguf_cache() / f"{path.stem}-{digest[:16]}"
    record = read_record(folder)
    if record is not None and record.get("sha256") == digest and (folder / "config.json").exists():
        return folder
    quantization = _quantization_or_refuse(path)
    model, tokenizer = _read(path)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # each process its own: two may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / RECORD).write_text(json.dumps({"gguf": path.name, "sha256": digest, "quantization": quantization,
                                          "dequantized_to": "float32"}, indent=1))
    record = read_record(folder)
    if record is not None and record.get("sha256") == digest:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


def _quantization_or_refuse(path: Path) -> str:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("reading a .gguf file needs the gguf package", code="gguf_missing",
                             remedy="pip install gguf") from None
    try:
        return quantization_of(path)
    except Exception as err:  # noqa: BLE001 - any parse failure is a damaged or foreign file
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(err).__name__}: {str(err)[:120]})",
                             code="gguf_unreadable", remedy="fetch the file again (a partial download?)") from None


def _read(path: Path) -> tuple[Any, Any]:
    """transformers' dequantized model, moved into a fresh model of its class without the GGUF marking."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"transformers could not read {path.name}: {str(err).splitlines()[0][:200]}",
                             code="gguf_unreadable",
                             remedy="check that transformers supports this GGUF architecture (pip install -U "
                             "transformers gguf)") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quantized.state_dict(), strict=False)
    tied = {k for k in missing if "lm_head" in k} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(f"the dequantized weights of {path.name} do not fit {type(fresh).__name__} "
                             f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})",
                             code="gguf_unreadable", remedy="update transformers and gguf")
    if tied:
        fresh.tie_weights()
    return fresh.eval(), tokenizer
