"""Would this circuit survive another sample of prompts? Circuit stability by bootstrap.

EAP / EAP-IG / exact edge scores are per prompt, so a resample of the prompts is a weighted mean of
those scores, accumulated block by block over the prompts; no gradient is recomputed. For B
resamples (multinomial weights, seeded) the circuit is chosen again with the same rule (top n or
threshold), and we report:

  inclusion[e]  the share of resamples whose circuit holds edge e
  jaccard       the mean pairwise Jaccard index |C_i & C_j| / |C_i | C_j| of the B circuits
  stable        the edges with inclusion >= `share` (its faithfulness is measured by edge patching)

Resampling prompts to ask how much a discovered circuit depends on the sample follows the
bootstrap idea of Efron & Tibshirani (1993); it answers the concern that IOI circuits found on GPT-2
small change when the prompts are resampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..stats import Resampler
from ..stats.sums import block_rows


@dataclass
class Stability:
    inclusion: Tensor  # [n_senders, n_receivers] share of resamples keeping each edge
    jaccard: float  # mean pairwise Jaccard of the resampled circuits
    jaccard_to_full: float  # mean Jaccard of a resampled circuit with the one found on all prompts
    stable: Tensor  # [n_senders, n_receivers] bool: inclusion >= share
    resamples: int
    share: float
    sizes: Tensor  # [B] edges in each resampled circuit


def circuit_stability(n: int, read: Callable[[int, int], np.ndarray], cells: Tensor, shape: tuple[int, int],
                      select: Callable[[Tensor], Tensor], full_kept: Tensor, resamples: int, share: float, seed: int,
                      mask: Tensor) -> Stability:
    """Per-prompt edge scores read in blocks (read(lo, hi) -> [rows, n_edges]; column j is the edge at flat
    position cells[j] of the [n_senders, n_receivers] grid `shape`); select(scores [S, R]) -> kept [S, R];
    full_kept: the circuit on all prompts. Memory: resamples x edges, whatever the number of prompts."""
    resampler = Resampler(n, resamples, seed)
    means = np.zeros((resamples, len(cells)))
    for lo in range(0, n, block_rows(len(cells))):  # each resample's mean score of every edge
        hi = min(n, lo + block_rows(len(cells)))
        means += resampler.block(lo, hi) @ np.asarray(read(lo, hi), dtype=np.float64)
    means /= n
    edges = mask.flatten().nonzero()[:, 0]
    kept = torch.zeros(resamples, len(edges), dtype=torch.float32)
    for b in range(resamples):  # each resample's circuit, chosen as on the whole dataset
        scores = torch.zeros(shape[0] * shape[1], dtype=torch.float32)
        scores[cells] = torch.from_numpy(means[b]).float()
        kept[b] = select(scores.view(shape)).flatten()[edges].float()
    inclusion = torch.zeros(mask.numel())
    inclusion[edges] = kept.mean(0)
    inter = kept @ kept.T  # [B, B]
    sizes = kept.sum(1)
    union = sizes[:, None] + sizes[None, :] - inter
    jac = torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(inter))
    off = ~torch.eye(resamples, dtype=torch.bool)
    full = full_kept.flatten()[edges].float()
    inter_full = kept @ full
    union_full = sizes + full.sum() - inter_full
    to_full = torch.where(union_full > 0, inter_full / union_full.clamp(min=1), torch.ones_like(inter_full))
    inclusion = inclusion.view(mask.shape)
    return Stability(inclusion, float(jac[off].mean()) if resamples > 1 else float("nan"), float(to_full.mean()),
                     (inclusion >= share) & mask, resamples, share, sizes)
