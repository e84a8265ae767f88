"""Loading models: the bundled demo, a local HuggingFace folder, or a hub name, on any backend.

`load_model` returns what a user would build themselves: a TransformerBridge, a HookedTransformer, or
an nnsight LanguageModel around the HuggingFace model; every operation accepts it (and `CachedModel`
around it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import ConfigError, ModelLoadError, UnsupportedModelError
from ..files import safetensors_problem
from .gguf import dequantized_folder, is_gguf, read_record

Backend = Literal["bridge", "hooked", "nnsight"]
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
               revision: str | None = None, device_map: str | dict[str, Any] | None = None) -> Any:
    """Load a model as a TransformerLens object or an nnsight LanguageModel.

    name:    "demo" (the bundled model), a local folder with a HuggingFace model and tokenizer, a `.gguf`
             file (dequantized to float32 through transformers once, into a cached folder: models/gguf.py;
             the quantization type is kept in the structure record and the manifest), or a HuggingFace hub
             name (needs the hub, or the model already in the local HF cache).
    backend: "bridge" (TransformerBridge: HuggingFace's own weights and activations) or "hooked"
             (HookedTransformer with TransformerLens's processing: LayerNorm folded, weights centred), or
             "nnsight" (nnsight.LanguageModel: HuggingFace's weights and activations, as a plain bridge's).
    compat:  bridge only: call `enable_compatibility_mode()` (HookedTransformer-equivalent numbers).
    device_map: HuggingFace's placement of a model larger than one device ("auto", "balanced", or
             {module: device}), passed to `from_pretrained` (accelerate); bridge and nnsight backends only,
             instead of `device`.
    """
    if backend not in ("bridge", "hooked", "nnsight"):
        raise ConfigError(f"unknown backend {backend!r}", remedy="use 'bridge', 'hooked' or 'nnsight'",
                          code="unknown_backend")
    if compat and backend != "bridge":
        raise ConfigError("compat applies to the bridge backend only (a HookedTransformer is already "
                          "processed)", remedy="drop compat, or use backend='bridge'",
                          code="compat_needs_bridge")
    if backend == "hooked":
        require_hooked()
    if backend == "nnsight":
        require_nnsight()
    check_device(device)
    check_device_map(device_map, device, backend)
    torch_dtype = _dtype(dtype)
    folder = DEMO_DIR if name == "demo" else Path(name).expanduser()
    if is_gguf(name):
        folder = dequantized_folder(folder)
    if name == "demo" and not (folder / "config.json").exists():
        raise ModelLoadError("the bundled demo model is missing from this installation",
                             remedy="reinstall entoscope, or train it: python scripts/train_demo.py "
                             "--out src/entoscope/demo", code="demo_missing")
    try:
        model = _load(name, folder, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                      revision=revision, device_map=device_map)
        checked(model)
    except UnsupportedModelError as err:
        if not is_gguf(name):
            raise
        arch = (read_record(folder) or {}).get("architecture") or _config_of(folder).get("model_type")
        raise UnsupportedModelError(f"{Path(name).name} (GGUF architecture {arch!r}): {err.message}", code=err.code,
                                    remedy=err.remedy) from None
    # how to load it again: the manifest keeps this, so `entoscope run manifest.json` re-runs (and Ray
    # workers load their replicas from it: entoscope.executors.spec)
    from .adapter import module_of

    module_of(model)._entoscope_source = {"name": name, "backend": backend, "compat": compat, "dtype": str(torch_dtype),
                                          "revision": revision, "device": device, "device_map": device_map}
    return model


def check_device_map(device_map: str | dict[str, Any] | None, device: str | None, backend: str) -> None:
    """device_map goes to HuggingFace's from_pretrained (accelerate places the modules), on its own."""
    if device_map is None:
        return
    if backend == "hooked":
        raise ConfigError("device_map places a HuggingFace model's modules; a HookedTransformer is built by "
                          "TransformerLens (n_devices)", code="device_map_unsupported",
                          remedy="use backend bridge or nnsight with device_map, or device with hooked")
    if device is not None:
        raise ConfigError(f"both device {device!r} and device_map {device_map!r} were given", code="device_and_map",
                          remedy="give one: device for a model on one device, device_map to spread it over several")
    if not isinstance(device_map, (str, dict)):
        raise ConfigError(f"device_map must be a name or a mapping, got {type(device_map).__name__}",
                          code="device_map_invalid", remedy="e.g. device_map: auto, or {'': 'cuda:0'}")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ConfigError("device_map needs the accelerate package", code="device_map_needs_accelerate",
                          remedy="pip install accelerate") from None


def require_hooked() -> None:
    """HookedTransformer exists in transformer-lens < 4 only; say so instead of an ImportError."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:
        import importlib.metadata as md

        raise ConfigError(f"the hooked backend needs HookedTransformer, which transformer-lens "
                          f"{md.version('transformer-lens')} no longer has (it was removed in 4.0)",
                          code="hooked_needs_tl3",
                          remedy="use --backend bridge (a TransformerBridge; add --compat for HookedTransformer-"
                          "equivalent numbers), or install transformer-lens 3: pip install 'transformer-lens>=3.2,<4'"
                          ) from None


def require_nnsight() -> None:
    """nnsight is an optional extra; say how to get it instead of an ImportError."""
    try:
        import nnsight  # noqa: F401
    except ImportError:
        raise ConfigError("the nnsight backend needs the nnsight package, which is not installed",
                          code="nnsight_missing",
                          remedy="pip install 'entoscope[nnsight]' (nnsight 0.8), or use --backend bridge") from None


def as_nnsight(hf_model: Any, tokenizer: Any, name: str) -> Any:
    """An nnsight LanguageModel around an in-memory HuggingFace model (the name kept for tables and caches)."""
    import warnings

    require_nnsight()
    from nnsight import LanguageModel

    with warnings.catch_warnings():  # 0.8 calls LanguageModel deprecated in favour of TransformersModel
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        lm = LanguageModel(hf_model, tokenizer=tokenizer)
    hf_model._entoscope_name = name
    return lm


def check_device(device: str | None) -> None:
    """A device string torch knows, whose device this machine has."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}", code="unknown_device",
                          remedy="use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
    available = bool(backend is not None and getattr(backend, "is_available", lambda: False)())
    count = int(getattr(backend, "device_count", lambda: 1)()) if available else 0
    if not available or (dev.index is not None and dev.index >= count):
        have = f"{count} {dev.type} device(s)" if available else f"no {dev.type} device"
        raise ConfigError(f"device {device!r} is not available: this machine has {have} "
                          f"(torch {torch.__version__})", code="device_unavailable",
                          remedy="use --device cpu, or install a torch build for this accelerator "
                          "(pip install torch with the matching CUDA/ROCm index)")


def _load(name: str, folder: Path, *, backend: Backend, compat: bool, device: str | None, dtype: torch.dtype,
          revision: str | None, device_map: str | dict[str, Any] | None = None) -> Any:
    torch_dtype = dtype
    if folder.is_dir():
        if not (folder / "config.json").exists():
            ggufs = sorted(f.name for f in folder.glob("*.gguf"))
            if ggufs:
                shown = ", ".join(ggufs[:4]) + (f" (and {len(ggufs) - 4} more)" if len(ggufs) > 4 else "")
                raise ModelLoadError(f"{folder} has no config.json, but holds GGUF file(s): {shown}",
                                     remedy=f"pass the file itself: --model {folder / ggufs[0]}",
                                     code="not_a_model_folder")
            raise ModelLoadError(f"{folder} has no config.json: not a HuggingFace model folder",
                                 remedy="point --model at a folder written by save_pretrained "
                                 "(config.json, weights, tokenizer files)", code="not_a_model_folder")
        return _load_folder(folder, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                            name="demo" if name == "demo" else None, device_map=device_map)
    if name.startswith((".", "/", "~")) or os.sep in name and not _looks_like_hub_id(name):
        raise ModelLoadError(f"no model folder at {name}", remedy="check the path", code="folder_missing")
    return _load_hub(name, backend=backend, compat=compat, device=device, dtype=torch_dtype,
                     revision=revision, device_map=device_map)


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json",
                 "tf_model.h5", "flax_model.msgpack")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


def check_folder(folder: Path) -> dict[str, Any]:
    """What a model folder must hold before loading it: a decoder's config, weights, a tokenizer."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{folder}/config.json cannot be read ({err})", code="not_a_model_folder",
                             remedy="point --model at a folder written by save_pretrained") from None
    if config.get("is_encoder_decoder"):
        raise UnsupportedModelError(f"{folder} holds an encoder-decoder model ({config.get('model_type')})",
                                    code="not_a_decoder",
                                    remedy="entoscope supports decoder-only transformers (GPT-2, GPT-NeoX, Llama, "
                                    "Qwen2, Mistral, ...)")
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise ModelLoadError(f"{folder} has a config.json but no weights (no *.safetensors or pytorch_model.bin)",
                             code="weights_missing",
                             remedy="save the weights there too (model.save_pretrained(folder)), or copy them in")
    for weights in sorted(folder.glob("*.safetensors")):  # the headers only: no tensor is read
        problem = safetensors_problem(weights)
        if problem:
            raise ModelLoadError(f"{weights} is {problem}", code="weights_damaged",
                                 remedy="copy or download the weights again (a partial download or copy?)")
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{folder} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}); every "
                             "prompt would tokenise to nothing", code="tokenizer_missing",
                             remedy="save the tokenizer into the folder: tokenizer.save_pretrained(folder)")
    return config


def _config_of(folder: Path) -> dict[str, Any]:
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_name_of(folder: Path, config: dict[str, Any]) -> str:
    """The name a folder's model goes by (tables, the report's title, manifests, a Jacobian lens's provenance):
    for a folder dequantized from a .gguf, the file's `general.name` (else the file's name); else the name its
    config records (`_name_or_path`; `_model_name_or_path`, where transformers puts a GGUF's name) unless that
    is a local path; else the folder's path."""
    record = read_record(folder) or {}
    if isinstance(record.get("name"), str) and record["name"].strip():
        return record["name"].strip()
    for key in ("_name_or_path", "_model_name_or_path"):
        value = config.get(key)
        if isinstance(value, str) and value.strip() and not _local_path(value.strip()):
            return value.strip()
    return Path(str(record["gguf"])).stem if record.get("gguf") else str(folder)


def _local_path(text: str) -> bool:
    """Whether a recorded name is a path on some machine (absolute, home- or dot-relative, or deeper than a hub
    repository's owner/name), which names nothing once the folder has moved."""
    return text.startswith((".", "/", "~", "\\")) or (len(text) > 1 and text[1] == ":") or text.count("/") > 1 \
        or "\\" in text


def _load_folder(folder: Path, *, backend: Backend, compat: bool, device: str | None,
                 dtype: torch.dtype, name: str | None, device_map: str | dict[str, Any] | None = None) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    config = check_folder(folder)
    name = name or model_name_of(folder, config)
    hf_logging.disable_progress_bar()  # a 3 MB model needs no "Loading weights" bar
    try:
        placed = {"device_map": device_map} if device_map is not None else {}
        hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager", **placed)
    except ValueError as err:
        if "Unrecognized configuration class" in str(err) or "for this kind of AutoModel" in str(err):
            raise UnsupportedModelError(f"{folder} does not hold a causal language model that transformers knows "
                                        f"({str(err).splitlines()[0][:160]})", code="not_a_decoder",
                                        remedy="entoscope supports decoder-only causal LMs (GPT-2, GPT-NeoX, Llama, "
                                        "Qwen2, Mistral, ...)") from None
        raise ModelLoadError(f"transformers could not load {folder}: {str(err).splitlines()[0][:200]}",
                             remedy="check that the folder was written by save_pretrained and matches "
                             "this transformers version") from None
    except OSError as err:
        raise ModelLoadError(f"transformers could not load {folder}: {str(err).splitlines()[0][:200]}",
                             remedy="check that the weight files are complete (a partial download?)") from None
    except Exception as err:  # noqa: BLE001 - a weight file that passed the header check but cannot be read
        unreadable = type(err).__name__ in ("SafetensorError", "UnpicklingError", "EOFError") or (
            type(err) is RuntimeError and "PytorchStreamReader" in str(err))  # a truncated pytorch_model.bin
        if not unreadable:
            raise
        first = (str(err).splitlines() or [""])[0][:200]
        files = ", ".join(sorted({f.name for pattern in _WEIGHT_FILES[:2] for f in folder.glob(pattern)}))
        raise ModelLoadError(f"the weights in {folder} ({files}) cannot be read ({type(err).__name__}: {first})",
                             code="weights_damaged",
                             remedy="copy or download the weights again (a partial download or copy?)") from None
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if len(tokenizer) < 2 or not tokenizer("a b", add_special_tokens=False)["input_ids"]:
        raise ModelLoadError(f"the tokenizer in {folder} has {len(tokenizer)} token(s): its vocabulary files are "
                             "missing or empty", code="tokenizer_missing",
                             remedy="save the tokenizer into the folder: tokenizer.save_pretrained(folder)")
    model = from_hf(hf_model, tokenizer, backend=backend, compat=compat, device=device, name=name, folder=str(folder))
    record = read_record(folder)
    if record is not None:  # dequantized from a GGUF file: the structure record says so (ModelAdapter)
        from .adapter import module_of

        module_of(model)._entoscope_quantization = f"GGUF {record['quantization']}"
    return model


def from_hf(hf_model: Any, tokenizer: Any, *, backend: Backend = "bridge", compat: bool = False,
            device: str | None = None, name: str = "local", folder: str | None = None) -> Any:
    """Wrap an in-memory HuggingFace causal LM (and its tokenizer) as a TransformerLens object (or, with
    backend="nnsight", an nnsight LanguageModel).

    The tokenizer must have been loaded from a folder (`AutoTokenizer.from_pretrained(folder)`):
    TransformerLens re-reads it from there to set up BOS handling.
    """
    if backend == "hooked":
        require_hooked()
    check_device(device)
    hf_model = hf_model.eval()
    if device is not None:
        hf_model = hf_model.to(device)
    if backend == "nnsight":
        return checked(as_nnsight(hf_model, tokenizer, name))
    if backend == "hooked":
        from .hooked_config import hooked_from_hf

        return checked(hooked_from_hf(hf_model, tokenizer, name=name, device=device))
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(name, hf_model=hf_model, tokenizer=tokenizer,
                                                 device=device)
    if compat:
        bridge.enable_compatibility_mode(disable_warnings=True)
    return checked(bridge)


def checked(model: Any) -> Any:
    """Run the adapter's load-time checks now (finite weights; tiny forwards showing the model is a pre-norm
    causal decoder, the unembedding included), so that a plan later runs no forward at all."""
    from .adapter import ModelAdapter

    ModelAdapter(model).check_unembedding()
    return model


def _hub_remedy(name: str) -> str:
    local = name.split("/")[-1]
    return (f"on a machine with internet, save it to a folder (hf download {name} --local-dir ./{local}) and "
            f"pass that folder: --model ./{local}; or use --model demo, the bundled model")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the HuggingFace hub answers a TCP connection now (no retries, a few seconds at most)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _in_local_cache(name: str, revision: str | None) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json", revision=revision)
        return isinstance(hit, str)
    except Exception:  # noqa: BLE001 - a malformed name is simply not cached
        return False


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Make huggingface_hub/transformers read the local cache only (no 30 s of connection retries)."""
    import huggingface_hub.constants as constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _load_hub(name: str, *, backend: Backend, compat: bool, device: str | None, dtype: torch.dtype,
              revision: str | None, device_map: str | dict[str, Any] | None = None) -> Any:
    reachable = hub_reachable()
    if not reachable and not _in_local_cache(name, revision):
        raise ModelLoadError(f"{name!r} is neither a local folder nor in the local HuggingFace cache, and the hub "
                             "cannot be reached (offline)", remedy=_hub_remedy(name), code="hub_unreachable")
    try:
        with contextlib.nullcontext() if reachable else _offline():
            if backend == "nnsight":
                from transformers import AutoModelForCausalLM, AutoTokenizer

                placed = {"device_map": device_map} if device_map is not None else {}
                hf = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, revision=revision,
                                                          attn_implementation="eager", **placed)
                hf = hf.eval() if device_map is not None else hf.eval().to(device or "cpu")
                return as_nnsight(hf, AutoTokenizer.from_pretrained(name, revision=revision), name)
            if backend == "hooked":
                from transformer_lens import HookedTransformer

                kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
                if revision is not None:
                    kwargs["revision"] = revision
                return HookedTransformer.from_pretrained(name, **kwargs)
            from transformer_lens.model_bridge import TransformerBridge

            placed = {"device_map": device_map} if device_map is not None else {}
            bridge = TransformerBridge.boot_transformers(name, device=device, dtype=dtype, revision=revision, **placed)
            if compat:
                bridge.enable_compatibility_mode(disable_warnings=True)
            return bridge
    except (OSError, ValueError) as err:  # hub unreachable, unknown repo, offline mode
        offline = not reachable or "offline" in str(err).lower() \
            or "connect" in str(err).lower() or "resolve" in str(err).lower()
        why = "the HuggingFace hub could not be reached" if offline else "loading failed"
        raise ModelLoadError(
            f"could not load {name!r} from the HuggingFace hub: {why} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})", remedy=_hub_remedy(name),
            code="hub_unreachable" if offline else "model_load_failed",
        ) from None
