"""Loading models: the bundled demo, a local HuggingFace folder, or a hub name, on either backend.

`load_model` returns a TransformerLens object (a TransformerBridge or a HookedTransformer), the same
thing a user would build themselves; every operation accepts it (and `CachedModel` around it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import ConfigError, ModelLoadError, UnsupportedModelError

Backend = Literal["bridge", "hooked"]
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", remedy=f"use one of {', '.join(_DTYPES)}",
                          code="unknown_dtype")
    return _DTYPES[dtype]


def load_model(name: str = "demo", *, backend: Backend = "bridge", compat: bool = False,
               device: str | None = None, dtype: str | torch.dtype = "float32",
               revision: str | None = None) -> Any:
    """Load a model as a TransformerLens object.

    name:    "demo" (the bundled model), a local folder with a HuggingFace model and tokenizer, or
             a HuggingFace hub name (needs the hub, or the model already in the local HF cache).
    backend: "bridge" (TransformerBridge: HuggingFace's own weights and activations) or "hooked"
             (HookedTransformer with TransformerLens's processing: LayerNorm folded, weights centred).
    compat:  bridge only: call `enable_compatibility_mode()` (HookedTransformer-equivalent numbers).
    """
    if backend not in ("bridge", "hooked"):
        raise ConfigError(f"unknown backend {backend!r}", remedy="use 'bridge' or 'hooked'",
                          code="unknown_backend")
    if compat and backend != "bridge":
        raise ConfigError("compat applies to the bridge backend only (a HookedTransformer is already "
                          "processed)", remedy="drop compat, or use backend='bridge'",
                          code="compat_needs_bridge")
    torch_dtype = _dtype(dtype)
    folder = DEMO_DIR if name == "demo" else Path(name).expanduser()
    if name == "demo" and not (folder / "config.json").exists():
        raise ModelLoadError("the bundled demo model is missing from this installation",
                             remedy="reinstall entoscope, or train it: python scripts/train_demo.py "
                             "--out src/entoscope/demo", code="demo_missing")
    model = _load(name, folder, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                  revision=revision)
    # how to load it again: the manifest keeps this, so `entoscope run manifest.json` re-runs
    model._entoscope_source = {"name": name, "backend": backend, "compat": compat, "dtype": str(torch_dtype),
                               "revision": revision}
    return model


def _load(name: str, folder: Path, *, backend: Backend, compat: bool, device: str | None, dtype: torch.dtype,
          revision: str | None) -> Any:
    torch_dtype = dtype
    if folder.is_dir():
        if not (folder / "config.json").exists():
            raise ModelLoadError(f"{folder} has no config.json: not a HuggingFace model folder",
                                 remedy="point --model at a folder written by save_pretrained "
                                 "(config.json, weights, tokenizer files)", code="not_a_model_folder")
        return _load_folder(folder, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                            name="demo" if name == "demo" else str(folder))
    if name.startswith((".", "/", "~")) or os.sep in name and not _looks_like_hub_id(name):
        raise ModelLoadError(f"no model folder at {name}", remedy="check the path", code="folder_missing")
    return _load_hub(name, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                     revision=revision)


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _load_folder(folder: Path, *, backend: Backend, compat: bool, device: str | None,
                 dtype: torch.dtype, name: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 3 MB model needs no "Loading weights" bar
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                    attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return from_hf(hf_model, tokenizer, backend=backend, compat=compat, device=device,
                   name=name, folder=str(folder))


def from_hf(hf_model: Any, tokenizer: Any, *, backend: Backend = "bridge", compat: bool = False,
            device: str | None = None, name: str = "local", folder: str | None = None) -> Any:
    """Wrap an in-memory HuggingFace causal LM (and its tokenizer) as a TransformerLens object.

    The tokenizer must have been loaded from a folder (`AutoTokenizer.from_pretrained(folder)`):
    TransformerLens re-reads it from there to set up BOS handling.
    """
    hf_model = hf_model.eval()
    if device is not None:
        hf_model = hf_model.to(device)
    if backend == "hooked":
        from .hooked_config import hooked_from_hf

        return hooked_from_hf(hf_model, tokenizer, name=name, device=device)
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(name, hf_model=hf_model, tokenizer=tokenizer,
                                                 device=device)
    if compat:
        bridge.enable_compatibility_mode(disable_warnings=True)
    return bridge


def _load_hub(name: str, *, backend: Backend, compat: bool, device: str | None, dtype: torch.dtype,
              revision: str | None) -> Any:
    try:
        if backend == "hooked":
            from transformer_lens import HookedTransformer

            kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
            if revision is not None:
                kwargs["revision"] = revision
            return HookedTransformer.from_pretrained(name, **kwargs)
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(name, device=device, dtype=dtype, revision=revision)
        if compat:
            bridge.enable_compatibility_mode(disable_warnings=True)
        return bridge
    except (OSError, ValueError) as err:  # hub unreachable, unknown repo, offline mode
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in str(err).lower() \
            or "connect" in str(err).lower() or "resolve" in str(err).lower()
        why = "the HuggingFace hub could not be reached" if offline else "loading failed"
        raise ModelLoadError(
            f"could not load {name!r} from the HuggingFace hub: {why} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})",
            remedy=f"on a machine with internet, save it to a folder (huggingface-cli download {name} "
            f"--local-dir ./{name.split('/')[-1]}) and pass that folder: --model ./{name.split('/')[-1]}; "
            "or use --model demo, the bundled model",
            code="hub_unreachable" if offline else "model_load_failed",
        ) from None
    except UnsupportedModelError:
        raise
