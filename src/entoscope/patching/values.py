"""Patch values: what a patched activation is set to, registered by name under kind "patch".

Each value is computed from the UNPATCHED runs, slot by slot (a slot is one member of one unit for
one prompt), never from the partly patched run: a group patched at several layers writes, at each
layer, a value worked out from the clean/corrupt runs. The runs (see docs/patching.md):

    base     the run being patched (denoising: the corrupt prompt; noising: the clean prompt)
    source   the other run of the same pair (denoising: clean; noising: corrupt)

Built-in values (`patch:` in the config, options in `patch_params:`):

    source    the source run's activation (classic activation patching)
    zero      zeros (zero ablation)
    mean      the mean of the source-role activation over the whole dataset, at the same position
              (counted from the first token, over the prompts that have it); per_position: false
              takes the mean over every position instead (mean ablation)
    resample  the source-role activation of ANOTHER example, drawn per example with the operation's
              seed among those of the same token length (resample ablation)
    scaled    factor x the base run's activation (of: base), or the source's (of: source)
    noise     the base run's activation plus Gaussian noise of standard deviation `std`, a different
              draw for every (prompt, unit, member), seeded by the operation's seed

Register your own with `patch_value`, saying which runs it needs:

    @patch_value("halfway", needs=("base", "source"))
    def halfway(inputs):
        return (inputs.base + inputs.source) / 2
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError
from ..registry import lookup, register

RUNS = ("base", "source", "mean", "resample")


@dataclass(frozen=True)
class PatchValue:
    """A registered patch value.

    fn:      fn(inputs: PatchInputs, **params) -> Tensor of shape inputs.shape.
    needs:   which runs it reads (subset of RUNS), or a function of the params giving them.
    params:  accepted params and their defaults (None: any params, passed as given).
    per_row: the value differs per (prompt, unit) (random draws): integrated gradients, which
             follows ONE path per activation, refuses it.
    copies_source: the value IS the source run's activation at the slot, so at positions before the first
             token where the base and source prompts differ it writes what the base run already holds
             (exact patching then skips those positions, and rows that patch nothing else: exact.py).
    """

    name: str
    fn: Callable[..., Tensor]
    needs: frozenset[str] | Callable[[dict[str, Any]], frozenset[str]] = frozenset()
    params: dict[str, Any] | None = field(default_factory=dict)
    per_row: bool = False
    copies_source: bool = False

    def runs(self, params: dict[str, Any]) -> frozenset[str]:
        needs = self.needs(params) if callable(self.needs) else self.needs
        unknown = set(needs) - set(RUNS)
        if unknown:
            raise ConfigError(f"patch value {self.name!r} needs unknown runs {sorted(unknown)}",
                              code="patch_needs_unknown", remedy=f"runs are {', '.join(RUNS)}")
        return frozenset(needs)

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The params with defaults filled in; unknown keys refused."""
        if self.params is None:
            return dict(params)
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ConfigError(f"patch {self.name!r} takes no parameter {', '.join(map(repr, unknown))}",
                              code="patch_param_unknown",
                              remedy=f"its parameters are {', '.join(self.params) or 'none'}")
        return {**self.params, **params}


def patch_value(name: str, *, needs: Iterable[str] | Callable[[dict[str, Any]], frozenset[str]] = (),
                params: dict[str, Any] | None = None, per_row: bool = False,
                replace: bool = False, copies_source: bool = False) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: register `fn(inputs, **params)` as the patch value `name`."""
    def decorate(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        runs = needs if callable(needs) else frozenset(needs)
        register("patch", name, replace=replace)(PatchValue(name, fn, runs, {} if params is None else params,
                                                            per_row, copies_source))
        return fn
    return decorate


def get_patch_value(name: str) -> PatchValue:
    """The registered value; a bare function registered with register("patch", ...) needs base and source."""
    obj = lookup("patch", name)
    if isinstance(obj, PatchValue):
        return obj
    return PatchValue(name, obj, frozenset(getattr(obj, "needs", ("base", "source"))), None,
                      bool(getattr(obj, "per_row", False)))


class PatchInputs:
    """What a patch value may read, for N slots, each as a tensor of `shape` = [N, *slot shape].

    base, source, mean, partner: the activations at the slots (fetched on first use);
    noise(): standard normal draws, one independent stream per (seed, example, unit, member).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 fetch: Callable[[str], Tensor], keys: Tensor, seed: int) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self._fetch = fetch
        self._keys = keys  # [N, 3]: example (in the dataset), unit, member
        self._seed = seed
        self._cache: dict[str, Tensor] = {}

    def _get(self, run: str) -> Tensor:
        if run not in self._cache:
            self._cache[run] = self._fetch(run)
        return self._cache[run]

    @property
    def base(self) -> Tensor:
        return self._get("base")

    @property
    def source(self) -> Tensor:
        return self._get("source")

    @property
    def mean(self) -> Tensor:
        return self._get("mean")

    @property
    def partner(self) -> Tensor:
        return self._get("resample")

    def zeros(self) -> Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def noise(self) -> Tensor:
        """Standard normal draws [N, ...]; slot i's draw depends only on (seed, its example, unit, member)."""
        out = torch.empty(self.shape, dtype=torch.float32)
        gen = torch.Generator()
        for i, key in enumerate(self._keys.tolist()):
            gen.manual_seed(stream_seed(self._seed, *key))
            out[i] = torch.randn(self.shape[1:], generator=gen)
        return out.to(self.device, self.dtype)


def stream_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (the same on every platform and Python release)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---------------------------------------------------------------------- built-ins
@patch_value("source", needs=("source",), copies_source=True)
def _source(inputs: PatchInputs) -> Tensor:
    return inputs.source


@patch_value("zero")
def _zero(inputs: PatchInputs) -> Tensor:
    return inputs.zeros()


@patch_value("mean", needs=("mean",), params={"per_position": True})
def _mean(inputs: PatchInputs, per_position: bool = True) -> Tensor:
    return inputs.mean  # per_position is read when the means are accumulated


@patch_value("resample", needs=("resample",))
def _resample(inputs: PatchInputs) -> Tensor:
    return inputs.partner


def _scaled_needs(params: dict[str, Any]) -> frozenset[str]:
    of = params.get("of", "base")
    if of not in ("base", "source"):
        raise ConfigError(f"patch scaled: of={of!r} is not a run", code="patch_param_invalid",
                          remedy="of: base (the patched run's own activation) or of: source")
    return frozenset({of})


@patch_value("scaled", needs=_scaled_needs, params={"factor": 0.0, "of": "base"})
def _scaled(inputs: PatchInputs, factor: float = 0.0, of: str = "base") -> Tensor:
    return float(factor) * (inputs.base if of == "base" else inputs.source)


@patch_value("noise", needs=("base",), params={"std": 1.0}, per_row=True)
def _noise(inputs: PatchInputs, std: float = 1.0) -> Tensor:
    return inputs.base + float(std) * inputs.noise()
