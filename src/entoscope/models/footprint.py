"""What a batch costs in memory: the terms every operation's plan adds up (`Plan.peak_memory_bytes`, memory.py).

Sizes are the model's own (its structure, the dtype of its activations); the estimates are of the resident peak
above the loaded model, on glibc with the heap steadied (heap.steady_heap), measured by
benchmarks/bench_memory.py on SmolLM2-135M, Gemma 3 270M and the Llama 3.2 1B shape (docs/speed.md, "Memory").

- `act(names, B, T)`: the activations a run reads and returns (its cache), exactly.
- `layer(B, T)`: the transient of one block's forward (attention and MLP intermediates), from the structure.
- `logits(rows)`: vocabulary-sized rows: the logits in the model's dtype and their float32 copy.
- `forward(B, T, logit_rows)`: a forward's own peak: the residual stream, and the larger of a block's transient
  and the logits (they are not alive together).
- `saved(B, T, frozen)`: what autograd keeps for a backward through every block, from the structure
  (`saved_rates`, checked against `torch.autograd.graph.saved_tensors_hooks` by the tests; a plan runs no
  model); `frozen`: with the weights not requiring gradients and the graph started at the embedding (what the
  Jacobian lens fit does), else with the weights as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:
    from .adapter import ModelAdapter

FIXED = 40 * 2**20  # a run's own small objects (Python, tables) and the heap's slack (blocks below 1 MiB)
FIXED_LEAN = 16 * 2**20  # the same for head scores: measured, its peak above the tensors its plan counts is 10-18
# MiB on SmolLM2, Gemma 3 and the Llama 3.2 1B / Gemma 2 2B shapes, against 30-45 for the others (docs/speed.md)


class Footprint:
    """The memory terms of one model (module docstring); every size in bytes."""

    def __init__(self, model: ModelAdapter) -> None:
        self.model = model
        self.s = model.structure
        self.f = torch.empty((), dtype=model.unembedding_dtype).element_size()

    # ------------------------------------------------------------------ exact sizes
    def act(self, names: Any, B: int, T: int) -> int:
        """Bytes of the activations `names` for B prompts of T tokens (their axes at T positions)."""
        total = 0
        for name in names:
            act = self.model.resolve(name)
            n = 1
            for size in self.model.axis_sizes(act, T).values():
                n *= size
            total += n
        return B * total * self.f

    def row(self, B: int, T: int, width: int | None = None) -> int:
        """[B, T, width] in the activations' dtype (width: d_model by default)."""
        return B * T * (width or self.s.d_model) * self.f

    def logits(self, rows: int) -> int:
        """rows x vocabulary: the logits in the model's dtype and a float32 copy (metrics, log-softmax)."""
        return rows * self.s.d_vocab * (self.f + 4)

    def vocab(self, rows: int, copies: float = 1.0, item: int = 4) -> int:
        """`copies` float32 (item bytes) tensors of rows x vocabulary."""
        return int(rows * self.s.d_vocab * item * copies)

    # ------------------------------------------------------------------ a forward's own peak
    def layer(self, B: int, T: int) -> int:
        """A block's transient: its attention (q, k, v and their rotated copies; scores, weights and their float32
        softmax) and its MLP (the up / gate projections and their product)."""
        s = self.s
        qkv = s.n_heads * s.d_head + 2 * s.n_kv_heads * s.d_head
        per_token = 3 * s.d_model + 3 * s.d_mlp + 2 * qkv
        return B * T * per_token * self.f + B * s.n_heads * T * T * (2 * self.f + 4)

    def forward(self, B: int, T: int, logit_rows: int | None = None) -> int:
        """A forward of B prompts of T tokens returning logits at `logit_rows` rows (default every position)."""
        rows = B * T if logit_rows is None else logit_rows
        return 2 * self.row(B, T) + max(self.layer(B, T), self.logits(rows))

    # ------------------------------------------------------------------ gradients
    def saved(self, B: int, T: int, *, frozen: bool = False) -> int:
        """What autograd keeps for a backward of B prompts of T tokens through every block (module docstring),
        plus the backward's own transient (a block's gradients)."""
        per_token, per_square = saved_rates(self.s, self.f, frozen)
        return int(B * T * per_token + B * T * T * per_square) + 2 * self.layer(B, T)


def saved_rates(s: Any, f: int, frozen: bool) -> tuple[float, float]:
    """(bytes per token, bytes per token x position) autograd saves in a forward through the whole model, from the
    structure: per block and token the inputs of its products and norms (8 d_model, the MLP's 3 or 4 d_mlp
    (gated), 2 x the q/k/v width, 4 d_model more with post-norms), per token x position each head's attention
    weights; with the weights frozen (the graph started at the embedding) the products' inputs that only the
    weights' gradients need are not kept (x 0.63). Fitted to what `torch.autograd.graph.saved_tensors_hooks`
    records on the demo model, SmolLM2-135M and Gemma 3 270M (within 16%: tests/test_memory_budget.py)."""
    qkv = s.n_heads * s.d_head + 2 * s.n_kv_heads * s.d_head
    floats = 8 * s.d_model + (4 if s.gated_mlp else 3) * s.d_mlp + 2 * qkv + (4 * s.d_model if s.post_norms else 0)
    share = 0.63 if frozen else 1.0
    return s.n_layers * floats * f * share, s.n_layers * s.n_heads * f
