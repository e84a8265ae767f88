"""A dictionary: a sparse autoencoder (SAE) or a transcoder, as tensors and two maps, encode and decode.

    features = encode(x_in)                        [..., d_sae]
    reconstruction = decode(features)              features @ W_dec + b_dec, [..., d_out]
    error = x_out - decode(encode(x_in))           what the dictionary misses (x_out = x_in for an SAE)

An SAE reads and reconstructs one activation (`hook_in == hook_out`); a transcoder reads one (an MLP's
input) and predicts another (that MLP's output). The encoders, per SAELens architecture name (the
input first centred by b_dec where `apply_b_dec_to_input`, SAEs only):

    standard   f = ReLU(x W_enc + b_enc)                                   (Bricken et al. 2023)
    topk       f = ReLU of the k largest entries of x W_enc + b_enc, zero elsewhere   (Gao et al. 2024)
    jumprelu   f = p * [p > threshold],  p = x W_enc + b_enc               (Rajamanoharan et al. 2024b)
    gated      f = [x W_enc + b_gate > 0] * ReLU(x (W_enc * exp(r_mag)) + b_mag)  (Rajamanoharan et al. 2024a)

(jumprelu: SAELens also applies ReLU before the step; with a non-negative threshold, as trained, that is
the same.) Decoding is linear in every architecture, which is what lets a feature edit be written as
`x + (f_new - f) @ W_dec`: exactly `decode(f_new) + error`, and bit-exactly x where nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
SPACES = ("plain", "processed", "any")


@dataclass
class Dictionary:
    """The weights of one SAE or transcoder and where in a model it sits.

    hook_in, hook_out: canonical activation names (`resid_post.1`; a transcoder: `mlp_in.1` -> `mlp_out.1`).
    space: the activations it was trained on: "plain" (a plain TransformerBridge, or a HookedTransformer
           loaded without processing: HuggingFace's numbers), "processed" (TransformerLens's processing:
           a HookedTransformer from from_pretrained, a bridge in compatibility mode; SAELens trains there),
           or "any" (the caller vouches for it).
    """

    architecture: str
    W_enc: Tensor  # [d_in, d_sae]
    W_dec: Tensor  # [d_sae, d_out]
    b_dec: Tensor  # [d_out]
    hook_in: str
    hook_out: str
    b_enc: Tensor | None = None  # [d_sae] (not used by gated)
    threshold: Tensor | None = None  # jumprelu [d_sae]
    b_gate: Tensor | None = None  # gated [d_sae]
    r_mag: Tensor | None = None
    b_mag: Tensor | None = None
    k: int | None = None  # topk
    apply_b_dec_to_input: bool = True
    space: str = "processed"
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # what the folder said besides the weights
    _copies: dict[tuple[str, torch.dtype], Dictionary] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ shape
    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.W_dec.shape[1])

    @property
    def is_transcoder(self) -> bool:
        return self.hook_in != self.hook_out

    def tensors(self) -> dict[str, Tensor]:
        """The weights by SAELens's names (what sae_weights.safetensors holds)."""
        names = ("W_enc", "W_dec", "b_enc", "b_dec", "threshold", "b_gate", "r_mag", "b_mag")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Dictionary:
        """This dictionary's weights on `device` in `dtype` (copies are kept, so repeated calls are free)."""
        key = (str(torch.device(device)), dtype)
        if all(t.device == torch.device(device) and t.dtype == dtype for t in self.tensors().values()):
            return self
        if key not in self._copies:
            moved = {n: t.to(device, dtype) for n, t in self.tensors().items()}
            self._copies[key] = replace(self, **moved, _copies={})
        return self._copies[key]

    # ------------------------------------------------------------------ maps
    def encode(self, x: Tensor) -> Tensor:
        """Feature activations [..., d_sae] of inputs [..., d_in]."""
        d = self.to(x.device, x.dtype)
        if d.apply_b_dec_to_input and not d.is_transcoder:
            x = x - d.b_dec
        if d.architecture == "gated":
            assert d.b_gate is not None and d.r_mag is not None and d.b_mag is not None
            gate = (x @ d.W_enc + d.b_gate) > 0
            magnitude = torch.relu(x @ (d.W_enc * d.r_mag.exp()) + d.b_mag)
            return magnitude * gate.to(x.dtype)
        assert d.b_enc is not None
        pre = x @ d.W_enc + d.b_enc
        if d.architecture == "standard":
            return torch.relu(pre)
        if d.architecture == "jumprelu":
            assert d.threshold is not None
            return torch.relu(pre) * (pre > d.threshold).to(x.dtype)
        assert d.k is not None
        top = torch.topk(pre, k=d.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def decode(self, features: Tensor) -> Tensor:
        """The reconstruction [..., d_out] of feature activations [..., d_sae]."""
        d = self.to(features.device, features.dtype)
        return features @ d.W_dec + d.b_dec

    def error(self, x_in: Tensor, x_out: Tensor | None = None) -> Tensor:
        """x_out - decode(encode(x_in)): the part of the activation the dictionary does not explain."""
        target = x_in if x_out is None else x_out
        return target - self.decode(self.encode(x_in))

    def write(self, x_out: Tensor, old: Tensor, new: Tensor) -> Tensor:
        """The activation after features change from `old` to `new`: decode(new) + error, as
        x_out + (new - old) @ W_dec (bit-exactly x_out where new == old)."""
        d = self.to(x_out.device, x_out.dtype)
        return x_out + (new - old).to(x_out.dtype) @ d.W_dec
