"""Would this circuit survive another sample of prompts? Circuit stability by bootstrap.

EAP / EAP-IG / exact edge scores are per prompt, so a resample of the prompts is a weighted mean of
those scores; no gradient is recomputed. For B resamples (multinomial weights, seeded) the circuit
is chosen again with the same rule (top n or threshold), and we report:

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

import torch
from torch import Tensor

from ..stats import resample_weights


@dataclass
class Stability:
    inclusion: Tensor  # [n_senders, n_receivers] share of resamples keeping each edge
    jaccard: float  # mean pairwise Jaccard of the resampled circuits
    jaccard_to_full: float  # mean Jaccard of a resampled circuit with the one found on all prompts
    stable: Tensor  # [n_senders, n_receivers] bool: inclusion >= share
    resamples: int
    share: float
    sizes: Tensor  # [B] edges in each resampled circuit


def circuit_stability(per_prompt: Tensor, select: Callable[[Tensor], Tensor], full_kept: Tensor, resamples: int,
                      share: float, seed: int, mask: Tensor) -> Stability:
    """per_prompt [E, S, R] edge scores; select(scores [S, R]) -> kept [S, R]; full_kept: the circuit on all prompts."""
    E = per_prompt.shape[0]
    W = torch.as_tensor(resample_weights(E, resamples, seed), dtype=per_prompt.dtype)
    flat = per_prompt.reshape(E, -1)
    edges = mask.flatten().nonzero()[:, 0]
    kept = torch.zeros(resamples, len(edges), dtype=torch.float32)
    for b in range(resamples):  # each resample's circuit, chosen as on the whole dataset
        scores = (W[b] @ flat / E).view(per_prompt.shape[1:])
        kept[b] = select(scores).flatten()[edges].float()
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
