"""Control tasks: labels that keep the label distribution but carry no property of the input.

Hewitt & Liang (2019, "Designing and Interpreting Probes with Control Tasks") give every word
*type* a random label, so a probe can only score on a control task by memorising type identity;
a probe's selectivity = task accuracy - control accuracy.

`shuffled_labels`: with one label per prompt there are no types to memorise, so the control is a
seeded permutation of the label vector (class counts preserved exactly). A probe fitted to it
cannot generalise, so its held-out score measures what the pipeline scores on labels unrelated to
the features (chance, plus any bias of the method) and selectivity is the margin above that.

`group_labels`: the type-level control, given a grouping key per example (e.g. the subject word,
the template, the entity): every group gets one label drawn from the empirical label distribution
(all its rows share it). Rows of one group may fall in both training and test rows, so a probe
that can tell the groups apart from the activations can memorise the control labels: a high
control score then warns that the probe is expressive enough to memorise rather than read out.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError

_SALT = 0x5EED  # control draws use their own stream, not the one the splits use


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) * 1_000_003 + _SALT)
    return g


def shuffled_labels(y: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """y permuted by a seeded permutation (same multiset of labels)."""
    perm = torch.randperm(y.shape[-1], generator=_gen(seed)).to(y.device)
    return y[..., perm]


def group_labels(y: torch.Tensor, groups, *, seed: int = 0) -> torch.Tensor:
    """One label per group, drawn (with replacement) from the labels of all rows."""
    groups = np.asarray(groups.cpu() if isinstance(groups, torch.Tensor) else groups)
    if groups.ndim != 1 or len(groups) != y.shape[-1]:
        raise DataError(
            f"groups has shape {groups.shape}, expected one key per example ({y.shape[-1]})",
            remedy="pass groups as a 1-D sequence aligned with the labels",
        )
    _, gid = np.unique(groups, return_inverse=True)
    gid = torch.from_numpy(gid.reshape(-1).astype(np.int64))
    n_groups = int(gid.max()) + 1
    draw = torch.randint(0, y.shape[-1], (n_groups,), generator=_gen(seed))
    return y[..., draw[gid].to(y.device)]
