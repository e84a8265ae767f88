"""ACDC (Conmy et al. 2023, "Towards Automated Circuit Discovery for Mechanistic Interpretability").

Greedy pruning from the output backwards, with our edge patching (a removed edge carries its
sender's corrupt value). Receivers are visited in reverse order (logits, then the MLP, the value,
key and query receivers of the last layer, and so on down); at each receiver that still matters
(it is the logits, or a computation that reads it still has a kept edge towards the output), its
incoming edges are tried from the latest sender to the earliest. An edge is removed when

    damage = value(circuit without the edge) - value(current circuit) < threshold      (metric "kl")
    damage = value(current circuit) - value(circuit without the edge) < threshold      (task metric)

where value is the metric averaged over prompts, "kl" being KL(clean model || circuit) at the
answer position (ACDC's default). With `absolute`, a task metric's damage is |difference| (removal
must not move the metric either way, as ACDC's abs_value_threshold). Edges into a receiver that no
longer matters are dropped without a forward pass. A budget bounds the forward passes; edges not
reached when it runs out stay in the circuit. Every decision is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
import torch

from ..operation import progress
from .edge_patching import EdgePatcher
from .graph import Circuit


@dataclass
class AcdcOutcome:
    circuit: Circuit  # pruned; scores = damage of each tested edge (NaN when untested)
    decisions: pd.DataFrame
    value: float  # the final circuit's metric value
    forward_passes: int
    budget_exhausted: bool


def acdc(patcher: EdgePatcher, threshold: float, *, kl: bool, absolute: bool = False,
         max_forward_passes: int | None = None, quiet: bool = False) -> AcdcOutcome:
    graph = patcher.graph
    kept = graph.mask.clone()
    damage = torch.full(kept.shape, float("nan"))
    live = torch.zeros(graph.n_receivers, dtype=torch.bool)
    live[-1] = True
    owners = graph.owner_matrix  # [R, S]
    current = float(patcher.full.mean())
    start_passes = patcher.forward_passes
    state = {"exhausted": False}
    rows: list[dict] = []

    def receiver_matters(r: int) -> bool:
        if r == graph.n_receivers - 1:
            return True
        senders = owners[r].nonzero()[:, 0]
        return bool((kept[senders] & live[None, :]).any())

    def candidates() -> Iterator[tuple[int, int]]:
        for r in range(graph.n_receivers - 1, -1, -1):
            upstream = graph.mask[:, r].nonzero()[:, 0].flip(0)
            if not receiver_matters(r):
                for s in upstream.tolist():
                    if kept[s, r]:
                        kept[s, r] = False
                        rows.append(_row(len(rows), graph.edge_name(s, r), "dropped: receiver no longer matters"))
                continue
            live[r] = True
            for s in upstream.tolist():
                yield s, r

    for s, r in progress(candidates(), total=graph.n_edges, desc="ACDC", quiet=quiet):
        used = patcher.forward_passes - start_passes
        if max_forward_passes is not None and used + patcher.passes_per_circuit > max_forward_passes:
            state["exhausted"] = True
            rows.append(_row(len(rows), graph.edge_name(s, r), "kept: budget exhausted"))
            continue
        kept[s, r] = False
        value = patcher.mean(kept)
        d = (value - current) if kl else (current - value)
        if absolute and not kl:
            d = abs(d)
        damage[s, r] = d
        removed = d < threshold
        if removed:
            before, current = current, value
        else:
            kept[s, r] = True
            before = current
        rows.append({**_row(len(rows), graph.edge_name(s, r), "removed" if removed else "kept"),
                     "value_before": before, "value_without": value, "damage": d,
                     "forward_passes": patcher.forward_passes - start_passes})
    circuit = Circuit(graph, damage.nan_to_num(nan=0.0), kept).pruned()
    circuit.scores = damage.masked_fill(~graph.mask, 0.0)
    decisions = pd.DataFrame(rows, columns=["step", "edge", "decision", "value_before", "value_without", "damage",
                                            "forward_passes"])
    return AcdcOutcome(circuit, decisions, current, patcher.forward_passes - start_passes, state["exhausted"])


def _row(step: int, edge: str, decision: str) -> dict:
    return {"step": step, "edge": edge, "decision": decision, "value_before": float("nan"),
            "value_without": float("nan"), "damage": float("nan"), "forward_passes": None}
