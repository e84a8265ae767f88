"""Reading one steering vector from a file, behind checks (.npy or .safetensors).

Kept apart on purpose: a shared checked reader of .npy / .safetensors files may replace it; the
steering package calls only `read_vector`. What is refused, each with its code: a missing file
(`direction_file_missing`), another suffix or an unreadable file (`direction_file_format`), a
safetensors key that is not in the file (`direction_file_key`), an array that is not one vector (2-D
without `row`, 3-D, a row out of range: `direction_shape`), a non-numeric dtype (`direction_file_format`).
Finiteness and norm are checked where every direction is (`direction.check_vector`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError

SUFFIXES = (".npy", ".safetensors")


def read_vector(path: str | Path, *, key: str | None = None, row: int | None = None) -> np.ndarray:
    """The vector stored in `path` as float64 [width]: a 1-D array, or row `row` of a 2-D one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"no direction file at {path}", code="direction_file_missing",
                        remedy="check the path (on a Ray cluster the file must exist on every node)")
    if file.suffix not in SUFFIXES:
        raise DataError(f"{path}: a direction is read from .npy or .safetensors, not {file.suffix or 'no suffix'}",
                        code="direction_file_format", remedy="save it with numpy.save or safetensors")
    array = _read_npy(file) if file.suffix == ".npy" else _read_safetensors(file, key)
    if array.dtype.kind not in "fiu":
        raise DataError(f"{path} holds {array.dtype} values, not numbers", code="direction_file_format",
                        remedy="save the vector as a float array")
    return _one_vector(array.astype(np.float64), row, str(path))


def _read_npy(file: Path) -> np.ndarray:
    try:
        return np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DataError(f"{file} is not a readable .npy array ({' '.join(str(err).split())[:160]})",
                        code="direction_file_format", remedy="save it with numpy.save (no pickled objects)") from None


def _read_safetensors(file: Path, key: str | None) -> np.ndarray:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="np") as f:
            keys = list(f.keys())
            if key is None:
                if len(keys) != 1:
                    raise DataError(f"{file} holds {len(keys)} tensors ({', '.join(keys[:8])}): which one is the "
                                    "direction?", code="direction_file_key", remedy="give key: NAME")
                key = keys[0]
            if key not in keys:
                raise DataError(f"{file} has no tensor {key!r}", code="direction_file_key",
                                remedy=f"its tensors: {', '.join(keys[:12])}")
            return f.get_tensor(key)
    except (SafetensorError, OSError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{file} is not a readable safetensors file ({' '.join(str(err).split())[:160]})",
                        code="direction_file_format", remedy="save it with safetensors.numpy.save_file") from None


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
