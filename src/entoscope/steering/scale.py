"""What a steering coefficient multiplies (`units`), and the site's typical norm that `residual_norm` measures.

    direction       c v: the direction as given (with `normalize`, its unit vector v^: c in activation units).
                    The default, and what every run before `units` existed did.
    residual_norm   c R v^, R the mean L2 norm of the activation at the direction's site over the steered
                    (task) prompts' positions, a leading BOS left out, in the unsteered run: c = 0.1 adds a
                    tenth of a typical activation's length there, whatever the direction's own norm.

Why: a mean difference's norm says nothing about the stream it is added to. On SmolLM2-135M the greater-than
direction at resid_pre.2 has norm 0.78 while the residual there is some tens long, so coefficients of +-0.5 in
direction units move the stream by about 1% of its length and the metric by nothing a reader would notice.
In residual units the same list of coefficients means the same push on every model (Turner et al. 2023 and
Panickssery et al. 2023 tune c per model and layer for this reason; here the unit is measured instead).

The BOS is left out because its activation is the same in every prompt (position 0 sees only itself) and is
often of outsized norm (an attention sink), so counted in it would make R depend on the prompts' lengths.
Sums are float64, per prompt (a sharded phase), and added in row order on the driver, so a Ray run measures
the same R bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import CheckFailedError
from ..models.adapter import ModelAdapter
from ..models.names import ActName

UNITS = ("direction", "residual_norm")


def prompt_norms(model: ModelAdapter, tokens: Tensor, lengths: Tensor, site: ActName, head: int | None,
                 bos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: the sum over its positions of ||x||_2 at `site` (and `head`), a leading BOS (position 0
    holding `bos_id`) left out, and how many positions were summed ([B] float64, [B] int64)."""
    with torch.no_grad():
        x = model.run(tokens, [site], logits=False)[site]
    if head is not None:
        x = x[:, :, head]
    norms = x.double().norm(dim=-1)  # [B, T]
    lengths = lengths.to(norms.device)
    first = (tokens[:, 0] == bos_id).long().to(norms.device) if bos_id is not None \
        else torch.zeros_like(lengths)
    t = torch.arange(norms.shape[1], device=norms.device)[None, :]
    mask = (t >= first[:, None]) & (t < lengths[:, None])
    return (norms * mask).sum(1).cpu().numpy(), mask.sum(1).cpu().numpy().astype(np.int64)


def typical_norm(sums: np.ndarray, counts: np.ndarray, where: str) -> float:
    """R = (sum of every prompt's sums) / (their positions), in row order (float64); refused where it is not a
    positive finite number (a site that holds zeros cannot set a scale)."""
    total, positions = float(np.sum(np.asarray(sums, np.float64))), int(np.sum(counts))
    R = total / positions if positions else float("nan")
    if not (np.isfinite(R) and R > 0):
        raise CheckFailedError(f"units residual_norm: the activation at {where} has mean norm {R:g} over the task "
                               f"prompts' {positions} positions, so it sets no scale", code="steering_units",
                               remedy="steer a site whose activations are not zero, or use units: direction")
    return R


def unit_length(units: str, normalize: bool, direction_norm: float, residual_norm: float | None) -> float:
    """The length a coefficient of 1 writes (add) or sets (set): R, 1 (normalize) or |v|."""
    if units == "residual_norm":
        assert residual_norm is not None
        return float(residual_norm)
    return 1.0 if normalize else float(direction_norm)


def scaled(vectors: Tensor, units: str, residual_norm: float | None) -> Tensor:
    """The vectors steered with: as given, or (residual_norm) each rescaled to length R."""
    if units != "residual_norm":
        return vectors
    assert residual_norm is not None
    norms = vectors.double().norm(dim=-1, keepdim=True)
    return (vectors.double() / norms * residual_norm).to(vectors.dtype)


def units_note(units: str, normalize: bool, residual_norm: Any = None) -> str:
    """One line for the plan and the page: what a coefficient multiplies."""
    if units == "residual_norm":
        at = "" if residual_norm is None else f" ({float(residual_norm):.4g})"
        return ("coefficients in units of the site's mean activation norm R" + at + " over the task prompts' "
                "positions, BOS left out: c adds c R along the direction's unit vector")
    return "coefficients in activation units (c times the unit vector)" if normalize \
        else "coefficients multiply the direction as given (c v)"
