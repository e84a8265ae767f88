"""Activations at one site, one vector per prompt, and the difference of two sets of them.

Where a prompt's vector is read (`read_at`, CAA reads the last token, Panickssery et al. 2023):
  "last"      the prompt's last token
  "mean"      the mean over the prompt's tokens; a leading BOS (position 0 holding the model's BOS
              token) is left out unless bos_in_mean. The BOS's activation is the same in every prompt
              (position 0 sees only itself) and often of outsized norm (an attention sink), so counted
              in it adds x_BOS (1/n+ - 1/n-) to a difference of prompts of lengths n+ and n-: a
              length effect, not the contrast.
  a role      the role's token (`END`, `YY`, `S2+1`; data/roles.py)

The difference (float64 throughout, so the mean does not depend on batch order):
  two sets    v = mean(positive) - mean(negative)
  pairs       v = mean over pairs of (prompt - counterfactual), which is the same number
  pca         pairs only: u = the top right singular vector of the centred paired differences, oriented
              so that u . mean >= 0, and v = (mean . u) u: the mean difference's component along the top
              principal component, so coefficients mean the same as for the mean difference (Zou et al.
              2023 read the first component of paired differences; the scale here is ours, docs/steering.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..sites import resolve_positions, role_ref

READ_AT = ("last", "mean")


def read_code(read_at: str, roles: Any, where: str) -> int | str:
    """"last" / "mean" as they are; a role reference as its position code (refused where the data lacks it)."""
    if read_at in READ_AT:
        return read_at
    return role_ref(read_at, roles, where)


def site_vectors(model: ModelAdapter, tokens: Tensor, lengths: Tensor, roles: Tensor | None, site: ActName,
                 head: int | None, at: int | str, bos_id: int | None = None) -> Tensor:
    """[B, width] float32: each prompt's vector at `site` (and `head`), read at `at` (see the module docstring);
    "mean" leaves out position 0 of the prompts that start with `bos_id` (None: every token counts)."""
    x = model.run(tokens, [site], logits=False)[site]
    if head is not None:
        x = x[:, :, head]
    lengths = lengths.to(x.device)
    if at == "mean":
        first = (tokens[:, 0] == bos_id).long().to(x.device) if bos_id is not None else torch.zeros_like(lengths)
        t = torch.arange(x.shape[1], device=x.device)[None, :]
        mask = ((t >= first[:, None]) & (t < lengths[:, None])).to(x.dtype)
        if bool((mask.sum(1) == 0).any()):
            raise DataError("a prompt has no token after its BOS to average over", code="direction_data",
                            remedy="give prompts with text, read_at last, or bos_in_mean: true")
        return ((x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).float().cpu()
    if at == "last":
        pos = lengths - 1
    else:
        pos = resolve_positions(torch.full_like(lengths, int(at)), lengths, roles).to(x.device)
    return x[torch.arange(x.shape[0], device=x.device), pos].float().cpu()


def difference(positive: np.ndarray, negative: np.ndarray, *, paired: bool, pca: bool) -> tuple[np.ndarray, dict]:
    """(v [width] float64, what was computed) from positive [n, width] and negative [m, width] vectors."""
    pos, neg = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if not len(pos) or not len(neg):
        raise DataError("a mean difference needs at least one prompt on each side", code="direction_data",
                        remedy="give prompts in both sets (or pairs with counterfactuals)")
    if paired:
        diffs = pos - neg
        mean = diffs.mean(0)
    else:
        mean = pos.mean(0) - neg.mean(0)
    info: dict[str, Any] = {"n_positive": int(len(pos)), "n_negative": int(len(neg)),
                            "mean_difference_norm": float(np.linalg.norm(mean))}
    if not pca:
        return mean, info
    if not paired:
        raise DataError("the principal component is taken of paired differences, and these two prompt sets are not "
                        "pairs", code="direction_pca_needs_pairs",
                        remedy="give pairs (data with counterfactuals and no negative set), or pca: false")
    centred = diffs - mean
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    u = vt[0]
    if float(u @ mean) < 0:
        u = -u
    info.update({"explained_variance_ratio": float(s[0] ** 2 / max(1e-300, float((s ** 2).sum()))),
                 "cosine_with_mean": float(u @ mean / max(1e-300, np.linalg.norm(mean)))})
    return float(mean @ u) * u, info
