"""Running the model with a set of edges kept and every other edge fed its sender's corrupt value.

Receiver r reads

    input(r) = (its input in this run) - sum over patched senders s of (s_actual - s_corrupt)

i.e. every kept edge carries the sender's output in this run, every patched edge the sender's output
on the corrupt prompt (MIB / EAP-IG's `evaluate_graph` semantics). All edges kept reproduces the
clean run; none kept, the corrupt run. The biases (attention b_O, MLP biases) are in every
receiver's input whatever is kept. The mechanics (each receiver recomputed from its own residual)
are in entoscope.models.split_inputs.PatchedRun.

`EdgePatcher` holds, per batch, the corrupt run's sender outputs and the clean run's (its logits,
residual stream and sender outputs), then evaluates any number of circuits with one forward pass
per circuit per batch. A circuit's run starts at the first block whose receivers read a patched edge
(everything below is the clean run: ACDC, which prunes from the logits down, mostly tries circuits
that differ from the clean run in late layers only), and unembeds the answer positions only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..data.tokenized import Batch
from ..metrics import at_positions, readable
from ..models.adapter import ModelAdapter
from ..models.split_inputs import CleanRun, PatchedRun, sender_outputs, sender_reads
from .graph import ComponentGraph

MetricFn = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def corrupt_senders(model: ModelAdapter, batch: Batch) -> tuple[Tensor, Tensor]:
    """(sender outputs on the corrupt prompts [B, T, n_senders, d_model], corrupt logits [B, T, V])."""
    assert batch.cf_tokens is not None
    out = model.run(batch.cf_tokens, sender_reads(model.structure))
    return sender_outputs(model, out.acts), out.logits


def run_with_edges(model: ModelAdapter, tokens: Tensor, corrupt: Tensor, graph: ComponentGraph,
                   kept: Tensor) -> Tensor:
    """Logits [B, T, V] of a run where only the edges in `kept` ([n_senders, n_receivers] bool) carry
    their sender's value in this run; every other edge of the graph carries its corrupt value."""
    patched = (graph.mask & ~kept.bool()).to(corrupt.dtype)
    with torch.no_grad():
        return PatchedRun(model, corrupt, patched).run(tokens).logits


class EdgePatcher:
    """Evaluates circuits on a set of clean/corrupt batches with a metric.

    The metric of a circuit is read at each prompt's last token with the clean run's logits as the
    reference (so "kl" is KL(clean || circuit)). `forward_passes` counts the batched passes made.
    """

    def __init__(self, model: ModelAdapter, graph: ComponentGraph, batches: Sequence[Batch],
                 metric: MetricFn) -> None:
        self.model, self.graph, self.batches, self.metric = model, graph, list(batches), metric
        self.forward_passes = 0
        self._corrupt: list[Tensor] = []
        self._clean: list[CleanRun] = []
        self._reference: list[Tensor] = []
        self._answers: list[tuple[Tensor, Tensor]] = []
        full, empty = [], []
        for b in self.batches:
            assert b.answers is not None and b.wrong_answers is not None
            C, corrupt_logits = corrupt_senders(model, b)
            clean = model.run(b.tokens, CleanRun.reads(model.structure))
            self.forward_passes += 2
            ref = readable(at_positions(clean.logits, b.last))  # float32 on a half-precision model; float64 kept
            answers, wrong = b.answers.to(ref.device), b.wrong_answers.to(ref.device)
            self._corrupt.append(C)
            self._clean.append(CleanRun.of(model, clean.acts))
            self._reference.append(ref)
            self._answers.append((answers, wrong))
            full.append(metric(ref, answers, wrong, ref).cpu())
            empty.append(metric(readable(at_positions(corrupt_logits, b.last)), answers, wrong, ref).cpu())
        self.order = torch.tensor([i for b in self.batches for i in b.index])
        self.full = self._in_order(torch.cat(full))
        self.empty = self._in_order(torch.cat(empty))

    def _in_order(self, values: Tensor) -> Tensor:
        """Per-prompt values in ascending dataset index (dataset order when the batches cover every prompt)."""
        return values[torch.argsort(self.order)]

    def per_prompt(self, kept: Tensor) -> Tensor:
        """The metric of the circuit `kept` for every prompt, in dataset order: [N]."""
        values = []
        patched = (self.graph.mask & ~kept.bool())
        for b, C, clean, ref, (answers, wrong) in zip(self.batches, self._corrupt, self._clean, self._reference,
                                                      self._answers):
            with torch.no_grad():
                logits = readable(PatchedRun(self.model, C, patched.to(C.dtype)).logits_at(b.last, b.tokens, clean))
            self.forward_passes += 1
            values.append(self.metric(logits, answers, wrong, ref).cpu())
        return self._in_order(torch.cat(values))

    def mean(self, kept: Tensor) -> float:
        return float(self.per_prompt(kept).mean())

    @property
    def passes_per_circuit(self) -> int:
        return len(self.batches)
