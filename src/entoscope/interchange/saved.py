"""What an interchange run folder holds beside its table: every cell's bases and the split of the pairs.

    bases.safetensors  one float64 [width, r] tensor per cell and basis, keyed "CELL/BASIS"
                       ("resid_post.2@END/das"); its metadata (JSON strings) give the cells in grid order,
                       the basis names, each basis's rank and the site's width. A learned basis is the one
                       DAS (or boundless DAS) kept; a fixed one is what its construction gave.
    split.json         which pairs trained the bases and which measured IIA: pair indices (pair k's base is
                       prompt k of the run's prompts, the manifest's data records), each pair's base and
                       source prompt, the seed and test_share that drew the split.

`load_bases(folder)` reads bases.safetensors back as {cell: {basis: [width, r] float64 array}}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..results.result import Result

BASES_FILE = "bases.safetensors"
SPLIT_FILE = "split.json"


class InterchangeResult(Result):
    """A Result that also saves every cell's bases (bases.safetensors) and the split of the pairs (split.json)."""

    def save_extra(self, folder: Path, files: list[str]) -> None:
        from safetensors.numpy import save_file

        cells: list[str] = self.extra.get("cells", [])
        bases: list[dict[str, np.ndarray]] = self.extra.get("bases", [])
        if cells and bases:
            tensors = {f"{cell}/{name}": np.ascontiguousarray(b, dtype=np.float64)
                       for cell, made in zip(cells, bases) for name, b in made.items()}
            meta = {"cells": json.dumps(cells), "bases": json.dumps(list(bases[0])),
                    "rank": json.dumps({k: int(v.shape[1]) for k, v in tensors.items()}),
                    "width": str(next(iter(tensors.values())).shape[0]) if tensors else "0",
                    "convention": "h' = h + s (h_source - h) B B^T, B [width, r] orthonormal columns"}
            save_file(tensors, str(folder / BASES_FILE), metadata=meta)
            files.append(BASES_FILE)
        split = self.extra.get("split")
        if split is not None:
            (folder / SPLIT_FILE).write_text(json.dumps(split, indent=1), encoding="utf-8")
            files.append(SPLIT_FILE)


def split_record(base: np.ndarray, source: np.ndarray, held: np.ndarray, seed: int, test_share: float) -> dict[str, Any]:
    """The split of the pairs as written to split.json (pair indices; each pair's base and source prompt)."""
    return {"train": [int(i) for i in np.flatnonzero(~held)], "held_out": [int(i) for i in np.flatnonzero(held)],
            "base_prompt": [int(i) for i in base], "source_prompt": [int(i) for i in source],
            "seed": int(seed), "test_share": float(test_share)}


def load_bases(folder: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """bases.safetensors of a saved interchange run (a folder or the file) as {cell: {basis: [width, r]}}."""
    from safetensors.numpy import load_file

    path = Path(folder)
    path = path / BASES_FILE if path.is_dir() else path
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in load_file(str(path)).items():
        cell, _, name = key.rpartition("/")
        out.setdefault(cell, {})[name] = value
    return out
