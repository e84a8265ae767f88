"""Patching's memory above the loaded model, as a function of its two sizes: the prompts of a chunk (the reference
runs and their cached activations) and the rows of a patched batch (memory.py; models/footprint.py).

- every prompt of a chunk keeps the activations its runs read (base, source, resample; a bridge's recorded
  keys and values from the first patched layer on);
- the reference forwards of a chunk: a forward of the chunk with logits at every position (in the model's dtype);
- exact: a batch of `rows` patched rows, each a forward (started part-way where the model can) with the answer
  position's logits only (at every position where a row writes the final norm's scale or the logits), and its
  own copy of the patched activation;
- attribution: the chunk's forward with gradients: what autograd saves for it, and the gradients of the
  patched activations;
- integrated gradients: `rows` interpolated rows (at most a chunk's prompts x its steps) run forward and backward
  the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED, Footprint
from ..models.names import ActName


def patching_footprint(model: ModelAdapter, reads: dict[str, list[ActName]], T: int, past_from: int | None,
                       method: str, path: str, patched: list[ActName]) -> Callable[[int, int], int]:
    """peak(chunk, rows) in bytes (module docstring)."""
    fp, s = Footprint(model), model.structure
    names = [n for run in reads.values() for n in run]
    kept = fp.act([{"rot_k": ActName("k", n.layer), "rot_q": ActName("q", n.layer)}.get(n.kind, n)
                   for n in names], 1, T)
    if past_from is not None and s.backend == "bridge":  # recorded keys and values (record_past)
        kept += 2 * (s.n_layers - past_from) * T * s.n_kv_heads * s.d_head * fp.f
    site = max((fp.act([a], 1, T) for a in patched), default=fp.row(1, T))  # a row writes one activation

    def peak(chunk: int, rows: int) -> int:
        reference = 2 * fp.row(chunk, T) + max(fp.layer(chunk, T), chunk * T * s.d_vocab * fp.f)  # logits kept whole
        if method == "exact":
            # a full forward (path none) unembeds only the answer position (partial.logits_at), unless a row
            # writes the final norm's scale or the logits: then the forward's logits at every position
            every = path == "none" and any(a.kind in ("final_scale", "logits") for a in patched)
            work = fp.forward(rows, T, logit_rows=None if every else rows) + rows * site
        elif method == "attribution":
            work = fp.saved(chunk, T) + fp.forward(chunk, T) + 2 * chunk * site
        else:
            work = fp.saved(rows, T) + fp.forward(rows, T, logit_rows=rows) + 2 * rows * site
        return FIXED + chunk * kept + max(reference, work)

    return peak
