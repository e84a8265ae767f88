"""`Direction`: one steering vector at a named site, with where it came from.

    site        canonical site name where the vector lives (`resid_pre.2`, `mlp_post.0`, `z.1` with `head`)
    vector      [width] float32, the site's last axis (d_model, d_mlp, d_head, a dictionary's d_sae)
    head        the head (kv_head under grouped-query attention for k / v) of a per-head site, else None
    provenance  how it was made (source, data, positions, norm, ...): recorded in the run's manifest

Constructors (sources.py): `Direction.mean_difference` (two prompt sets, or the two sides of contrastive
pairs: CAA, Panickssery et al. 2023; optionally the top principal component of the paired differences),
`Direction.from_probe` (a fitted probe's direction), `Direction.from_feature` (an SAE / transcoder
feature's decoder row), `Direction.from_file` (.npy / .safetensors). `save` / `load` write and read
`direction.safetensors` (a run saves its direction and random baseline there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from ..models.names import parse_name

FORMAT = "entoscope.direction/1"
FILE = "direction.safetensors"


def canonical_site(site: str) -> str:
    """The canonical spelling of a site name (aliases accepted; the model checks the layer range later)."""
    return str(parse_name(site))


def check_vector(vector: Any, where: str) -> Tensor:
    """A direction's values as a float32 CPU tensor [width], refused when not one finite non-zero vector."""
    try:
        v = vector.detach().to("cpu", torch.float64) if isinstance(vector, Tensor) \
            else torch.as_tensor(np.asarray(vector, dtype=np.float64))
    except (TypeError, ValueError):
        raise DataError(f"{where}: the direction's values are not numbers", code="direction_shape",
                        remedy="give a 1-D vector of numbers of the site's width") from None
    if v.dim() != 1:
        raise DataError(f"{where}: a direction is one vector, not shape {tuple(v.shape)}", code="direction_shape",
                        remedy="give a 1-D vector of the site's width")
    if not bool(torch.isfinite(v).all()):
        bad = (~torch.isfinite(v)).nonzero().flatten()[:5].tolist()
        raise DataError(f"{where}: the direction holds NaN or inf (entries {bad})", code="direction_non_finite",
                        remedy="check how the vector was made; every entry must be a finite number")
    if float(v.norm()) == 0.0:
        raise DataError(f"{where}: the direction is the zero vector: steering along it does nothing and its random "
                        "baseline has no norm", code="direction_zero",
                        remedy="check how the vector was made (two identical prompt sets give a zero mean difference)")
    f32 = v.to(torch.float32)
    if not bool(torch.isfinite(f32).all()) or float(f32.norm()) == 0.0:
        raise DataError(f"{where}: the direction does not fit in float32 (its entries overflow or vanish)",
                        code="direction_non_finite", remedy="rescale the vector")
    return f32


@dataclass
class Direction:
    """A vector at a site, with its provenance (see the module docstring)."""

    site: str
    vector: Tensor
    head: int | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.site = canonical_site(self.site)
        self.vector = check_vector(self.vector, f"direction at {self.site}")
        if self.head is not None and (isinstance(self.head, bool) or not isinstance(self.head, int) or self.head < 0):
            raise DataError(f"direction at {self.site}: head must be a head index >= 0, not {self.head!r}",
                            code="direction_shape", remedy="give the head (or kv head) index")

    # ------------------------------------------------------------------ values
    @property
    def width(self) -> int:
        return int(self.vector.numel())

    @property
    def norm(self) -> float:
        return float(self.vector.double().norm())

    @property
    def unit(self) -> Tensor:
        return (self.vector.double() / self.vector.double().norm()).to(torch.float32)

    def random_like(self, seed: int) -> Direction:
        """A seeded random direction of the same norm at the same site (standard normal, rescaled; its own CPU
        generator, so the same seed gives the same vector on every machine)."""
        g = torch.Generator(device="cpu").manual_seed(int(seed) * 7919 + 0x57EE)
        r = torch.randn(self.width, generator=g, dtype=torch.float64)
        r = r / r.norm() * self.vector.double().norm()
        return Direction(self.site, r.to(torch.float32), self.head, {"source": "random", "seed": int(seed),
                                                                     "norm_of": "the steering direction"})

    @property
    def where(self) -> str:
        """The site it is written at, and its head where it is one head's."""
        return self.site + (f" head {self.head}" if self.head is not None else "")

    def describe(self) -> str:
        source = str(self.provenance.get("source", "given")).replace("_", "-")
        return f"the {source} direction at {self.where} (norm {self.norm:.3g})"

    # ------------------------------------------------------------------ config form
    def as_spec(self) -> dict[str, Any]:
        """The config form (`DirectionSpec` with source "vector"): its values travel in the config and manifest."""
        return {"source": "vector", "site": self.site, "head": self.head,
                "values": [float(x) for x in self.vector.tolist()], "provenance": dict(self.provenance)}

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, *, random: Direction | None = None) -> Path:
        """Write `path` (a .safetensors file, or FILE inside a folder): the vector (and a random baseline) with
        the site, head and provenance in its metadata."""
        from safetensors.torch import save_file

        target = Path(path)
        if target.suffix != ".safetensors":
            target = target / FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"direction": self.vector.contiguous()}
        if random is not None:
            tensors["random"] = random.vector.contiguous()
        meta = {"format": FORMAT, "site": self.site, "head": self.head, "provenance": self.provenance}
        save_file(tensors, str(target), metadata={"entoscope": json.dumps(meta, default=str)})
        return target

    @classmethod
    def load(cls, path: str | Path, *, which: str = "direction") -> Direction:
        """The direction saved at `path` (a file written by `save`, or a run folder holding FILE); which="random"
        gives the run's random baseline."""
        from safetensors import safe_open

        target = Path(path)
        if target.is_dir():
            target = target / FILE
        if not target.is_file():
            raise DataError(f"no saved direction at {path}", code="direction_file_missing",
                            remedy="give a file written by Direction.save, or a steering run's folder "
                            f"(it holds {FILE})")
        with safe_open(str(target), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("entoscope", "{}"))
            if meta.get("format") != FORMAT or which not in f.keys():
                raise DataError(f"{target} is not a saved entoscope direction (or has no {which!r} vector)",
                                code="direction_file_format",
                                remedy="read plain vectors with Direction.from_file(path, site=...)")
            vector = f.get_tensor(which)
        provenance = meta.get("provenance", {}) if which == "direction" else {"source": "random"}
        return cls(meta["site"], vector, meta.get("head"), provenance)

    # ------------------------------------------------------------------ constructors (sources.py)
    @classmethod
    def mean_difference(cls, model: Any, site: str, data: Any, negative: Any = None, **kwargs: Any) -> Direction:
        from .sources import mean_difference

        return mean_difference(model, site, data, negative, **kwargs)

    @classmethod
    def from_probe(cls, probing: Any, site: str | None = None, **kwargs: Any) -> Direction:
        from .sources import from_probe

        return from_probe(probing, site, **kwargs)

    @classmethod
    def from_feature(cls, dictionary: Any, feature: int, model: Any = None) -> Direction:
        from .sources import from_feature

        return from_feature(dictionary, feature, model)

    @classmethod
    def from_file(cls, path: str | Path, site: str, *, key: str | None = None, row: int | None = None,
                  head: int | None = None) -> Direction:
        from .sources import from_file

        return from_file(path, site, key=key, row=row, head=head)
