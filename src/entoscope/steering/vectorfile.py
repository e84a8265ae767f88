"""Reading one steering vector from a file (.npy or .safetensors), through the checked reader every user
file goes through (files.py: truncated, damaged, pickled or empty files refused).

The steering package calls only `read_vector`. What is refused, each with its code: a missing file
(`direction_file_missing`), another suffix or an unreadable file (`direction_file_format`), a
safetensors key that is not in the file (`direction_file_key`), an array that is not one vector (2-D
without `row`, 3-D, a row out of range: `direction_shape`), a non-numeric dtype (`direction_file_format`).
Finiteness and norm are checked where every direction is (`direction.check_vector`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..files import read_tensors

SUFFIXES = (".npy", ".safetensors")


def _unreadable(message: str) -> DataError:
    return DataError(message, code="direction_file_format",
                     remedy="save it with numpy.save or safetensors (no pickled objects)")


def read_vector(path: str | Path, *, key: str | None = None, row: int | None = None) -> np.ndarray:
    """The vector stored in `path` as float64 [width]: a 1-D array, or row `row` of a 2-D one (`key`: which
    tensor of a safetensors file; an .npy holds one)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"no direction file at {path}", code="direction_file_missing",
                        remedy="check the path (on a Ray cluster the file must exist on every node)")
    if file.suffix not in SUFFIXES:
        raise DataError(f"{path}: a direction is read from .npy or .safetensors, not {file.suffix or 'no suffix'}",
                        code="direction_file_format", remedy="save it with numpy.save or safetensors")
    tensors, _ = read_tensors(file, refuse=_unreadable, floating=False, finite=False)
    if file.suffix == ".npy":
        key = ""
    elif key is None:
        if len(tensors) != 1:
            raise DataError(f"{file} holds {len(tensors)} tensors ({', '.join(list(tensors)[:8])}): which one is the "
                            "direction?", code="direction_file_key", remedy="give key: NAME")
        key = next(iter(tensors))
    if key not in tensors:
        raise DataError(f"{file} has no tensor {key!r}", code="direction_file_key",
                        remedy=f"its tensors: {', '.join(list(tensors)[:12])}")
    t = tensors[key]
    if t.dtype == torch.bool or t.is_complex():
        raise DataError(f"{path} holds {str(t.dtype).removeprefix('torch.')} values, not numbers",
                        code="direction_file_format", remedy="save the vector as a float array")
    return _one_vector(t.to(torch.float64).numpy(), row, str(path))


def _one_vector(array: np.ndarray, row: int | None, where: str) -> np.ndarray:
    if array.ndim == 1 and row is None:
        return array
    if array.ndim == 2 and row is not None:
        if not -array.shape[0] <= row < array.shape[0]:
            raise DataError(f"{where}: row {row} is out of range for {array.shape[0]} rows", code="direction_shape",
                            remedy=f"give row in 0..{array.shape[0] - 1}")
        return array[row]
    what = "give row: N to take one row of it" if array.ndim == 2 else "save one vector (1-D)"
    raise DataError(f"{where} holds an array of shape {tuple(array.shape)}, not one vector", code="direction_shape",
                    remedy=what)
