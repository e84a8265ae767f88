"""Subspaces to intervene on: orthonormal bases B [width, r] (columns orthonormal), fixed or learned.

Every fixed basis is made from the training pairs only (the held-out pairs measure it):

    mean_difference  the difference of the class means of the variable's value (two values: mu_1 - mu_0;
                     more: the top singular directions of the centred class means), as in CausalGym's
                     mean-difference baseline (Arora et al. 2024)
    probe            a logistic probe's weights on the variable's value (L2-regularised, fit here on the
                     training prompts' activations; several values: one weight vector per value, orthonormalised)
    pca              the top r principal directions of the training pairs' differences h_source - h_base
    neurons          the r coordinates of the site's own basis (neurons of mlp_post, features of a feature
                     site, dimensions of the residual stream) whose class means differ most (|mu_1 - mu_0|)
    random           a seeded random orthonormal basis (Haar: the Q of a Gaussian matrix's QR)
    sae              the span of chosen features' decoder directions (rows of a dictionary's W_dec, at the site
                     the dictionary writes), orthonormalised: the subspace those SAE features write
                     (Cunningham et al. 2023; Huang et al. 2024's RAVEL compares SAE features with DAS)
    das              learned by distributed alignment search, rank r (runs.py; Geiger et al. 2024)
    boundless_das    learned by boundless DAS: a rotation and a learned soft boundary, so the rank is learned
                     too (runs.Learned; Wu et al. 2023)

Principal angles between two subspaces (Bjorck & Golub 1973): the singular values of B1^T B2 are their
cosines; `overlap` is their mean square, ||B1^T B2||_F^2 / min(r1, r2), 1 for nested subspaces and about
r / width for random ones (the projection kernel's normalised score).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FIXED = ("mean_difference", "probe", "pca", "neurons", "random", "sae")
LABELLED = ("mean_difference", "probe", "neurons")  # need each prompt's value of the variable
LEARNED = ("das", "boundless_das")  # trained (runs.Learned)
KNOWN = LEARNED + FIXED
OWN_RANK = ("boundless_das", "sae")  # their rank is their own (learned; the features chosen), not `rank`


def orthonormal(vectors: Tensor, rank: int) -> Tensor:
    """An orthonormal basis [width, k] of the span of the columns of `vectors` [width, m] (k <= rank; columns of
    nearly zero norm dropped), by QR in float64."""
    v = vectors.double()
    if v.shape[1] == 0:
        return v
    q, r = torch.linalg.qr(v)
    keep = r.diagonal().abs() > 1e-10 * max(1.0, float(r.diagonal().abs().max()))
    return q[:, keep][:, :rank]


def random_basis(width: int, rank: int, generator: torch.Generator) -> Tensor:
    """A Haar-random orthonormal [width, rank] basis."""
    g = torch.randn(width, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(r.diagonal())[None, :]


def mean_difference_basis(acts: Tensor, labels: Tensor, rank: int) -> Tensor:
    """Class means of `acts` [N, width] by label [N], centred; their top singular directions (two classes: the
    unit difference of the two means)."""
    values = sorted(set(labels.tolist()))
    means = torch.stack([acts[labels == v].double().mean(0) for v in values])
    centred = means - means.mean(0, keepdim=True)
    u, s, vh = torch.linalg.svd(centred, full_matrices=False)
    keep = s > 1e-10 * max(1.0, float(s.max()))
    return vh[keep][: min(rank, len(values) - 1)].T.contiguous()


def neuron_basis(acts: Tensor, labels: Tensor, rank: int) -> Tensor:
    """The r standard basis vectors whose coordinates' class means spread most (largest range over classes)."""
    values = sorted(set(labels.tolist()))
    means = torch.stack([acts[labels == v].double().mean(0) for v in values])
    spread = means.max(0).values - means.min(0).values
    idx = torch.argsort(spread, descending=True, stable=True)[:rank]
    out = torch.zeros(acts.shape[1], len(idx), dtype=torch.float64)
    out[idx, torch.arange(len(idx))] = 1.0
    return out


def probe_basis(acts: Tensor, labels: Tensor, rank: int, l2: float = 1e-3, steps: int = 200) -> Tensor:
    """A logistic (softmax) probe on standardised activations, fit by L-BFGS; its weight vectors mapped back to
    activation space (w / std), centred over classes and orthonormalised."""
    x = acts.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-8)
    z = (x - mu) / sd
    values = sorted(set(labels.tolist()))
    y = torch.tensor([values.index(v) for v in labels.tolist()])
    W = torch.zeros(z.shape[1], len(values), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(len(values), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ W + b, y) + l2 * (W * W).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    w = W.detach() / sd[:, None]
    w = w - w.mean(1, keepdim=True)
    return orthonormal(w, min(rank, len(values) - 1))


def decoder_basis(W_dec: Tensor, features: list[int]) -> Tensor:
    """An orthonormal basis of the span of the decoder directions W_dec[features] ([d_sae, width])."""
    return orthonormal(W_dec[features].T, len(features))


def pca_basis(differences: Tensor, rank: int) -> Tensor:
    """The top r principal directions of the pairs' differences [N, width] (centred)."""
    d = differences.double()
    d = d - d.mean(0, keepdim=True)
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    keep = s > 1e-10 * max(1.0, float(s.max()) if len(s) else 1.0)
    return vh[keep][:rank].T.contiguous()


def principal_cosines(a: Tensor, b: Tensor) -> Tensor:
    """Cosines of the principal angles between span(a) and span(b) (orthonormal columns), largest first."""
    if a.shape[1] == 0 or b.shape[1] == 0:
        return torch.zeros(0, dtype=torch.float64)
    return torch.linalg.svdvals(a.double().T @ b.double()).clamp(0.0, 1.0)


def overlap(a: Tensor, b: Tensor) -> tuple[float, float]:
    """(mean squared cosine of the principal angles, the smallest principal angle in degrees)."""
    c = principal_cosines(a, b)
    if len(c) == 0:
        return math.nan, math.nan
    return float((c * c).mean()), math.degrees(math.acos(float(c[0])))


def interchange(h: Tensor, source: Tensor, basis: Tensor, strength: float) -> Tensor:
    """h' = h + s (source - h) B B^T (Geiger et al. 2021, 2024): the base's coordinates inside span(B) moved
    toward the source's (s = 1: set to them), the coordinates outside kept. h, source [R, width]; basis
    [width, r] or [R, width, r]."""
    diff = source - h
    B = basis.to(h.dtype)
    coords = diff @ B if B.dim() == 2 else torch.einsum("rw,rwk->rk", diff, B)
    move = coords @ B.T if B.dim() == 2 else torch.einsum("rk,rwk->rw", coords, B)
    return h + strength * move


def placebo(h: Tensor, source: Tensor, reference_move: Tensor, basis: Tensor) -> Tensor:
    """The norm-matched placebo: h moved by (source - h) projected on a random subspace, rescaled to the length
    of the reference intervention's move |reference_move| (per row). Rows whose random projection is zero
    are left unmoved."""
    diff = source - h
    B = basis.to(h.dtype)
    move = torch.einsum("rk,rwk->rw", torch.einsum("rw,rwk->rk", diff, B), B) if B.dim() == 3 else (diff @ B) @ B.T
    norm = move.norm(dim=-1, keepdim=True)
    scale = torch.where(norm > 0, reference_move.norm(dim=-1, keepdim=True) / norm.clamp_min(1e-30),
                        torch.zeros_like(norm))
    return h + move * scale
