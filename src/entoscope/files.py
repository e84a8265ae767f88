"""Tensor files a user hands over (`.safetensors`, `.npy`), read behind one check.

    tensors, metadata = read_tensors(path)          every tensor of the file, and its string metadata
    direction = read_array(path, key="direction")   one array: an .npy, or one tensor of a safetensors file

Refused before anything uses them, with the file named and what is wrong (`tensor_file_invalid` by
default; a caller passes `refuse` to raise its own class and code, e.g. `dictionary_corrupt`):

- a path that is missing, a folder, or an empty file;
- a file that is neither format, or one that is truncated or damaged (safetensors checks its header and
  that the data it promises is all there; numpy checks the .npy header and the array's length);
- an .npy of Python objects (never unpickled: `allow_pickle=False`);
- non-floating tensors where the caller needs floats, and NaN or infinity (with the count and the
  tensor's name).

Shapes are the caller's to check (a dictionary's widths against each other, a direction against
d_model). Dictionaries (models/dictionaries/saelens.py), tuned-lens translators (lens/tuned.py), steering
vectors (steering/vectorfile.py) and probe directions (probing/result.py) read their tensors here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .errors import DataError, EntoscopeError

Refuse = Callable[[str], EntoscopeError]
SUFFIXES = (".safetensors", ".npy")


def _default_refuse(message: str) -> EntoscopeError:
    return DataError(message, code="tensor_file_invalid",
                     remedy="write the file again (safetensors.torch.save_file or numpy.save) or copy it again")


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"


def read_tensors(path: str | Path, *, refuse: Refuse | None = None, floating: bool = True,
                 finite: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a .safetensors or .npy file (an .npy's one array under the key ""), and the
    safetensors metadata ({} for .npy), checked as the module docstring says."""
    refuse = refuse or _default_refuse
    p = Path(path).expanduser()
    if not p.exists():
        raise refuse(f"no file at {p}")
    if not p.is_file():
        raise refuse(f"{p} is not a file")
    if p.stat().st_size == 0:
        raise refuse(f"{p} is empty")
    if p.suffix == ".npy":
        tensors, metadata = {"": _read_npy(p, refuse)}, {}
    elif p.suffix == ".safetensors":
        tensors, metadata = _read_safetensors(p, refuse)
    else:
        raise refuse(f"{p}: unknown tensor file type {p.suffix!r} (read: {', '.join(SUFFIXES)})")
    for key, t in tensors.items():
        name = f"{p} ({key})" if key else str(p)
        if floating and not t.is_floating_point():
            raise refuse(f"{name} holds {str(t.dtype).removeprefix('torch.')} values where floating-point numbers "
                         "belong")
        if finite and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise refuse(f"{name} holds {bad} NaN or infinite value(s) of {t.numel()}")
    return tensors, metadata


def read_array(path: str | Path, key: str | None = None, *, refuse: Refuse | None = None,
               floating: bool = True, finite: bool = True) -> torch.Tensor:
    """One array: an .npy file's, or the tensor `key` of a safetensors file (without key: its only one)."""
    refuse = refuse or _default_refuse
    tensors, _ = read_tensors(path, refuse=refuse, floating=floating, finite=finite)
    if key is None and len(tensors) == 1:
        return next(iter(tensors.values()))
    if key is None or key not in tensors:
        have = ", ".join(sorted(tensors)) or "none"
        raise refuse(f"{path} has no tensor {key!r} (it has: {have})" if key is not None else
                     f"{path} holds {len(tensors)} tensors ({have}): name the one to read")
    return tensors[key]


def _read_safetensors(p: Path, refuse: Refuse) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError, ... all mean: not a usable file
        raise refuse(f"{p} is not a readable safetensors file (truncated or damaged? {_why(err)})") from None
    return tensors, metadata


def safetensors_problem(path: str | Path) -> str:
    """'' when the safetensors file's header parses and the data it promises is all there (checked without
    reading the tensors: a model folder's weights, before a load); else what is wrong, in a few words."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError, ... all mean: not a usable file
        return f"truncated or damaged ({_why(err)})"
    return ""


def _read_npy(p: Path, refuse: Refuse) -> torch.Tensor:
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - ValueError (pickled objects, bad header), EOFError, OSError
        raise refuse(f"{p} is not a readable .npy array (truncated, damaged, or of Python objects? "
                     f"{_why(err)})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise refuse(f"{p} holds {getattr(arr, 'dtype', type(arr).__name__)} values, not numbers")
    return torch.from_numpy(np.ascontiguousarray(arr))
