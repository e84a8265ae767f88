"""What a steering run holds at its peak (memory.py, models/footprint.py), following runs.py's order of work.

For a batch of B prompts of (at most) T tokens and steered rows `rows` at a time:

- unsteered: the batch's forward with logits at every position, and their log-softmax (float32; float64 for a
  float64 model), which is kept for the KL while the batch's steered rows run;
- steered: with those B x T log-probabilities kept, the larger of a forward of `rows` rows with logits at every
  position, and, once it returned, its logits (model dtype) and the KL / loss chunk of `_loss_and_kl`: a slice
  of at most LOGIT_VALUES vocabulary values (whole rows) held five times at once (the slice's log-softmax, the
  unsteered rows gathered for it, exp, the difference, their product);
- continuing (continuations): a forward of `rows` rows of T + tokens positions, the last position's logits only.

The peak is the largest of these (they are not alive together) and FIXED. Measured by benchmarks/bench_memory.py
(docs/speed.md); the KL chunk dominates on a vocabulary of 49k-262k tokens.
"""

from __future__ import annotations

from ..models.adapter import ModelAdapter
from ..models.footprint import FIXED, Footprint
from .runs import LOGIT_VALUES

KL_COPIES = 5  # vocabulary-sized slices alive at once in runs._kl (module docstring)


class SteeringFootprint:
    """peak(B, rows): the estimated peak above the loaded model of a batch of B prompts whose steered rows run
    `rows` at a time (module docstring); `steered`: whether any row is steered, `tokens`: continuation tokens."""

    def __init__(self, model: ModelAdapter, T: int, *, steered: bool, tokens: int = 0) -> None:
        self.fp, self.T, self.steered, self.tokens = Footprint(model), T, steered, tokens
        self.V = model.structure.d_vocab
        self.item = 8 if self.fp.f == 8 else 4  # runs._log_softmax: float64 for a float64 model, else float32

    def logp(self, B: int) -> int:
        """The unsteered log-probabilities of B prompts at every position, kept for the KL."""
        return B * self.T * self.V * self.item

    def forward(self, B: int) -> int:
        """A forward of B prompts returning their logits at every position, in the model's dtype (no copy)."""
        logits = B * self.T * self.V * self.fp.f
        return 2 * self.fp.row(B, self.T) + max(self.fp.layer(B, self.T), logits)

    def unsteered(self, B: int) -> int:
        """The forward, then its logits with their log-softmax (and its float32 copy, below float32)."""
        copy = self.logp(B) if self.fp.f < self.item else 0
        return max(self.forward(B), B * self.T * self.V * self.fp.f + copy + self.logp(B))

    def steered_rows(self, B: int, rows: int) -> int:
        """The kept log-probabilities, and the rows' forward or their logits with the KL chunk. runs.py's chunk
        holds whole rows, LOGIT_VALUES // (T V) of them: a batch shorter than T can hold more positions (up to
        LOGIT_VALUES, or one row of T), so the chunk is counted at its most over the batches' lengths."""
        per_row = self.T * self.V
        chunk = min(rows * per_row, max(per_row, LOGIT_VALUES)) * self.item
        logits = rows * per_row * self.fp.f
        return self.logp(B) + max(self.forward(rows), logits + KL_COPIES * chunk)

    def continuing(self, rows: int) -> int:
        return self.fp.forward(rows, self.T + self.tokens, logit_rows=rows) + self.fp.vocab(rows, 2)

    def peak(self, B: int, rows: int) -> int:
        return FIXED + max(self.unsteered(B), self.steered_rows(B, rows) if self.steered else 0,
                           self.continuing(rows) if self.tokens else 0)
