"""GGUF files: a quantized checkpoint read by transformers (the `gguf` package) and dequantized to an ordinary
HuggingFace folder, which every backend then loads like any other.

transformers marks a model read with `gguf_file=` as GGUF-quantized (`save_pretrained` refuses it); its state dict
in a fresh model of the same class, built from the config less `quantization_config`, is an ordinary model with the
same logits. A file whose tensors do not cover the model (transformers would fill the rest with random values, and
say so only in a log) is refused (`gguf_tensors_missing`). The folder keeps a record (`entoscope_gguf.json`: the
file, its SHA-256, the quantization type, the model's name `general.name`, the architecture, each file's size) that
the structure record and the manifest carry, and the pages say the weights are dequantized.

One mechanism makes and finds every folder: `dequantized_folder`, keyed by the file's SHA-256. Each folder it makes
or reuses (in the GGUF cache, or where the caller put it: scripts/fetch_real_models.py) is entered in the cache's
index (`by-sha256/<digest>.json`), so a .gguf loaded by path reuses the folder the fetch script made instead of
converting it again. A folder is used only after a check (`intact`: its record names the file's SHA-256, every
file it lists has its recorded size, every safetensors file's header covers its length); a damaged one is converted
again, with a warning (`gguf_cache_rebuilt`). A byte changed in place, the length kept, is not detected: that would
mean hashing the folder (0.5 GB for SmolLM2-135M) on every load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError, warn

RECORD = "entoscope_gguf.json"
INDEX = "by-sha256"


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
    return header_of(path)["quantization"]


def header_of(path: Path) -> dict[str, str | None]:
    """What the file's header says: quantization (as `quantization_of`), name (general.name, None when absent),
    architecture (general.architecture)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    quantization = None
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        try:
            quantization = gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    if quantization is None:
        counts: dict[str, int] = {}
        for t in reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        quantization = max(counts, key=counts.__getitem__) if counts else "unknown"
    return {"quantization": quantization, "name": _text(reader, "general.name"),
            "architecture": _text(reader, "general.architecture")}


def _text(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8").strip() or None
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


def read_record(folder: Path) -> dict[str, Any] | None:
    """The GGUF record of a dequantized folder (None for an ordinary one)."""
    try:
        record = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def intact(folder: Path, digest: str) -> str:
    """'' when `folder` is a usable dequantization of the file with SHA-256 `digest`; else what is wrong with it."""
    from ..files import safetensors_problem

    record = read_record(folder)
    if record is None or record.get("sha256") != digest:
        return "no record of this file"
    if not (folder / "config.json").is_file():
        return "config.json is missing"
    files = record.get("files")
    for name, size in (files.items() if isinstance(files, dict) else ()):
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return f"{name} is {'missing' if not f.is_file() else f'{f.stat().st_size} bytes, not {size}'}"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "it holds no weights"
    for f in weights:
        problem = safetensors_problem(f)
        if problem:
            return f"{f.name}: {problem}"
    return ""


def _index_entry(digest: str) -> Path:
    return gguf_cache() / INDEX / f"{digest}.json"


def _indexed(digest: str) -> Path | None:
    try:
        folder = json.loads(_index_entry(digest).read_text()).get("folder")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(folder) if isinstance(folder, str) else None


def _enter(digest: str, folder: Path) -> None:
    """Enter `folder` in the cache's index under the file's SHA-256 (atomically; a cache that cannot be written
    is left alone: the index saves work, nothing depends on it)."""
    entry = _index_entry(digest)
    if _indexed(digest) == folder.resolve():
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"folder": str(folder.resolve())}))
        tmp.replace(entry)
    except OSError:
        pass


def dequantized_folder(path: str | Path, folder: str | Path | None = None) -> Path:
    """A HuggingFace folder holding `path`'s weights dequantized to float32 (made once; reused while `intact`).
    With `folder`, that folder (made there unless it already holds this file's intact dequantization); without,
    the folder the cache's index names for this file's SHA-256 (wherever it was made), else the GGUF cache's
    (ENTOSCOPE_GGUF_CACHE or ~/.cache/entoscope/gguf)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}", code="folder_missing", remedy="check the path")
    digest = sha256_of(path)
    target = Path(folder) if folder is not None else gguf_cache() / f"{path.stem}-{digest[:16]}"
    candidates = [target] if folder is not None else list(dict.fromkeys(
        c.resolve() for c in (_indexed(digest), target) if c is not None))
    damaged = []
    for candidate in candidates:
        problem = intact(candidate, digest)
        if not problem:
            _enter(digest, candidate)
            return candidate
        if (read_record(candidate) or {}).get("sha256") == digest:  # made from this file, and unusable now
            damaged.append(f"{candidate} ({problem})")
    if damaged:
        warn(f"the dequantized folder of {path.name} is damaged: {'; '.join(damaged)}; converting the file again",
             code="gguf_cache_rebuilt")
    header = _header_or_refuse(path)
    model, tokenizer = _read(path)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")  # each process its own: two may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    (tmp / RECORD).write_text(json.dumps({"gguf": path.name, "sha256": digest, **header,
                                          "dequantized_to": "float32", "files": files}, indent=1))
    if not intact(target, digest):  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    _enter(digest, target)
    return target


def _header_or_refuse(path: Path) -> dict[str, str | None]:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("reading a .gguf file needs the gguf package", code="gguf_missing",
                             remedy="pip install gguf") from None
    try:
        return header_of(path)
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
        quantized, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"transformers could not read {path.name}: {str(err).splitlines()[0][:200]}",
                             code="gguf_unreadable",
                             remedy="check that transformers supports this GGUF architecture (pip install -U "
                             "transformers gguf)") from None
    config = quantized.config
    tied_head = {k for k in info.get("missing_keys", ()) if "lm_head" in k} \
        if getattr(config, "tie_word_embeddings", False) else set()
    absent = sorted(set(info.get("missing_keys", ())) - tied_head)
    if absent:  # transformers filled these with a random initialisation (its log says MISSING)
        n = len(quantized.state_dict())
        raise ModelLoadError(f"{path.name} lacks {len(absent)} of the {n} weight tensors of its "
                             f"{type(quantized).__name__} ({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}):"
                             " they would be random values", code="gguf_tensors_missing",
                             remedy="fetch or convert the file again: it is damaged or incomplete")
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
