"""The Jacobian lens (Gurnee et al. 2026, "Verbalizable Representations Form a Global Workspace in
Language Models", Transformer Circuits Thread): one d_model x d_model matrix per layer,

    J[l] = mean over prompts of  (1/|V|) sum_{t in V} sum_{t' in V} d h_final[t'] / d h_l[t]

where h_l is block l's output (resid_post.l), h_final the last block's output before the final norm,
and V a prompt's positions from `skip_first` (default 16) to the one before its last. The readout
transports a state to the last block's output and decodes it as the model decodes its own:
lens(h_l) = W_U norm(J[l] h_l) + b_U. The identity J gives the logit lens.

Fitting (`JacobianLensFit`, jacobian_fit.py) is sharded over prompts and exact: shards add their
per-prompt matrices in float64 and the merge divides by the prompt count once.

File format: TransformerLens 4.3's (`transformer_lens.tools.analysis.JacobianLens.save/load`, itself the
reference implementation's): one torch file with `J` ({layer: [d, d]}, float16 by default), `n_prompts`,
`source_layers`, `d_model` and a `metadata` dict of plain values; entoscope adds `settledness` (a
top-level key TransformerLens ignores). Read with torch.load(weights_only=True): nothing executable is
unpickled. A folder holds the file as `lens.pt` (TransformerLens's `from_pretrained(folder)` name).

Coordinates: a lens fitted on a plain bridge reads HuggingFace's residual stream (the published lenses'
convention); on a compat bridge or a HookedTransformer the stream is centred and the norms folded, so
the matrices differ. The metadata records the mode and a lens is refused on another one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, ModelLoadError
from ..models.adapter import ModelAdapter, adapt
from ..models.names import ActName

FILE = "lens.pt"
ESTIMATOR = "jacobian_lens"
# metadata keys that are not provenance: a merge may combine lenses that differ in them
NOT_PROVENANCE = ("n_prompts",)


class JacobianLens:
    """Fitted transport matrices {source layer: [d_model, d_model]} (float32, CPU), the prompt count, the
    provenance (`metadata`) and, when fitted here, each layer's settledness (relative change of J[l]
    between the even- and odd-numbered prompts; `JacobianLensFit`)."""

    def __init__(self, jacobians: dict[int, Tensor], *, n_prompts: int, d_model: int,
                 metadata: dict[str, Any] | None = None, settledness: dict[int, float] | None = None) -> None:
        if not jacobians:
            raise ConfigError("a Jacobian lens needs at least one layer", code="jacobian_lens_corrupt",
                              remedy="fit the lens again (entoscope train-lens --method jacobian)")
        for layer, m in jacobians.items():
            if tuple(m.shape) != (d_model, d_model):
                raise ConfigError(f"J[{layer}] has shape {tuple(m.shape)}, expected ({d_model}, {d_model})",
                                  code="jacobian_lens_corrupt", remedy="fit the lens again")
        self.jacobians = {int(k): v.detach().float().cpu() for k, v in jacobians.items()}
        self.n_prompts, self.d_model = int(n_prompts), int(d_model)
        self.metadata = dict(metadata or {})
        self.settledness = dict(settledness or {})
        target = self.metadata.get("target_layer")
        self.target = int(target) if isinstance(target, int) else max(self.jacobians) + 1

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.jacobians)

    def __repr__(self) -> str:
        s = self.source_layers
        return f"JacobianLens(layers={s[0]}..{s[-1]}, d_model={self.d_model}, n_prompts={self.n_prompts})"

    # ------------------------------------------------------------------ fit (the sharded operation)
    @classmethod
    def fit(cls, model: Any, data: Any, *, executor: Any = None, quiet: bool = False, shards_dir: Any = None,
            resume: bool = False, **settings: Any) -> JacobianLens:
        """Fit over a dataset (texts): settings are `JacobianLensFit`'s fields (skip_first, max_length,
        layers, dim_chunk, corpus, ...). The fit's table (per-layer settledness) is `lens.fit_result`."""
        from .jacobian_fit import JacobianLensFit

        result = JacobianLensFit(**settings).run(model, data, executor=executor, quiet=quiet,
                                                 shards_dir=shards_dir, resume=resume)
        lens: JacobianLens = result.extra["lens"]
        lens.fit_result = result  # type: ignore[attr-defined]
        return lens

    # ------------------------------------------------------------------ readout
    def index_of(self, act: ActName) -> int | None:
        """The matrix a residual state is read through; None is the identity (the last block's output,
        the lens's target: check_model sets it from the model)."""
        if act.kind not in ("resid_post", "resid_pre"):
            raise ConfigError(f"the Jacobian lens transports block outputs (resid_post, resid_pre), not {act.kind}",
                              code="jacobian_lens_site", remedy="use resid_post sites, or method 'logit'")
        layer = act.layer if act.kind == "resid_post" else (act.layer or 0) - 1
        if layer == self.target:
            return None
        if layer not in self.jacobians:
            raise ConfigError(f"{act} needs J[{layer}], which this lens has not (it has layers "
                              f"{self.source_layers})", code="jacobian_lens_site",
                              remedy="read the layers the lens was fitted on, or fit it on more layers")
        return layer

    def transform(self, h: Tensor, index: int | None) -> Tensor:
        """h [..., d_model] -> J[index] h (float32); the identity for index None."""
        if index is None:
            return h
        m = self.jacobians[index].to(h.device)
        return (h.float() @ m.T).to(h.dtype)

    def check_model(self, model: ModelAdapter) -> None:
        s = model.structure
        bad = s.d_model != self.d_model or any(not 0 <= L < s.n_layers - 1 for L in self.jacobians)
        mode = self.metadata.get("entoscope_mode", "plain")
        self.target = s.n_layers - 1
        if bad:
            raise ConfigError(f"this lens is for d_model {self.d_model} and layers {self.source_layers}; the model "
                              f"has d_model {s.d_model} and {s.n_layers} layers", code="jacobian_lens_mismatch",
                              remedy="fit a Jacobian lens for this model (entoscope train-lens --method jacobian)")
        target = self.metadata.get("target_layer", s.n_layers - 1)
        if target != s.n_layers - 1:
            raise ConfigError(f"this lens targets layer {target}, not the model's last ({s.n_layers - 1})",
                              code="jacobian_lens_mismatch", remedy="fit the lens on this model")
        if mode != s.mode:
            raise ConfigError(f"this lens was fitted on a {mode} model; this one is {s.mode} (another residual basis)",
                              code="jacobian_lens_mismatch",
                              remedy="load the model the way it was loaded for the fit, or fit the lens again")

    def lens_vectors(self, model: Any, layer: int) -> Tensor:
        """The lens vectors at `layer`: row t is J[layer]^T W_U[:, t], [d_vocab, d_model] (float32)."""
        a = adapt(model)
        W_U = a.weights.W_U.detach().float().cpu()  # [d_model, d_vocab]
        return (self.jacobians[layer].T @ W_U).T

    def decompose(self, model: Any, activation: Tensor, layer: int, k: int = 25) -> Any:
        """Block `layer`'s output `activation` [d_model] as a sparse nonnegative combination of at most k lens
        vectors (jspace.decompose: greedy selection, NNLS re-solve); the supports are token ids."""
        from .jspace import decompose

        return decompose(activation, self.lens_vectors(model, layer), k)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
        """Write TransformerLens's format. A path ending in .pt is the file; otherwise a folder with lens.pt."""
        p = Path(path)
        if p.suffix != ".pt":
            p.mkdir(parents=True, exist_ok=True)
            p = p / FILE
        payload: dict[str, Any] = {"J": {k: v.to(dtype) for k, v in self.jacobians.items()},
                                   "n_prompts": self.n_prompts, "source_layers": self.source_layers,
                                   "d_model": self.d_model}
        if self.metadata:
            payload["metadata"] = dict(self.metadata, n_prompts=self.n_prompts)
        if self.settledness:
            payload["settledness"] = {int(k): float(v) for k, v in self.settledness.items()}
        torch.save(payload, p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> JacobianLens:
        """Read ours, TransformerLens's (`JacobianLens.save`) or the reference package's file, or a folder
        holding lens.pt; a reference fit checkpoint (`jacobian_sum`, `n_done`) is divided by its count."""
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / FILE
        if not p.exists():
            raise ModelLoadError(f"no Jacobian lens at {p}", code="jacobian_lens_missing",
                                 remedy="give the .pt file (or its folder) written by JacobianLens.save, "
                                 "TransformerLens or `entoscope train-lens --method jacobian`")
        corrupt = dict(code="jacobian_lens_corrupt", remedy="fit the lens again or copy the file again: it is "
                       "damaged or from another program")
        try:
            payload = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged or foreign pickle: unusable
            raise ModelLoadError(f"{p} cannot be read as a Jacobian lens ({type(err).__name__})", **corrupt) from None
        if not isinstance(payload, dict) or not ({"J", "jacobian_sum"} & set(payload)):
            raise ModelLoadError(f"{p} has neither 'J' (a lens) nor 'jacobian_sum' (a fit checkpoint)", **corrupt)
        metadata = payload.get("metadata") or {}
        if "J" in payload:
            mats, n = payload["J"], int(payload.get("n_prompts", 0))
        else:
            n = int(payload.get("n_done", payload.get("n_prompts", 0)))
            if n <= 0:
                raise ModelLoadError(f"{p} is a fit checkpoint with n_done={n}", **corrupt)
            mats = {k: v.float() / n for k, v in payload["jacobian_sum"].items()}
            if "target_layer" in payload:
                metadata = dict(metadata, target_layer=payload["target_layer"])
        if not isinstance(mats, dict) or not mats or not all(torch.is_tensor(v) and v.ndim == 2 for v in mats.values()):
            raise ModelLoadError(f"{p}: its matrices are not a mapping of layer -> [d, d] tensors", **corrupt)
        mats = {int(k): v for k, v in mats.items()}
        if not all(bool(torch.isfinite(v.float()).all()) for v in mats.values()):
            raise ModelLoadError(f"{p}: its matrices hold NaN or inf", **corrupt)
        d_model = int(payload.get("d_model", next(iter(mats.values())).shape[0]))
        try:
            return cls(mats, n_prompts=n, d_model=d_model, metadata=metadata, settledness=payload.get("settledness"))
        except ConfigError as err:
            raise ModelLoadError(f"{p}: {err}", **corrupt) from None

    @classmethod
    def merge(cls, lenses: Sequence[JacobianLens]) -> JacobianLens:
        """Lenses fitted on disjoint prompts as one: each layer's matrices averaged weighted by the prompt
        counts (sums in float64). Refused unless the lenses agree on layers, d_model and every provenance
        field but the prompt count (model, mode, corpus, estimator settings)."""
        if not lenses:
            raise ConfigError("nothing to merge", code="jacobian_merge_mismatch", remedy="give at least one lens")
        first = lenses[0]
        prov = {k: v for k, v in first.metadata.items() if k not in NOT_PROVENANCE}
        for i, other in enumerate(lenses):
            if other.n_prompts <= 0:
                raise ConfigError(f"lens {i} records {other.n_prompts} prompts", code="jacobian_merge_mismatch",
                                  remedy="merge only fitted lenses (a positive n_prompts)")
            if other.source_layers != first.source_layers or other.d_model != first.d_model:
                raise ConfigError(f"lens {i} has layers {other.source_layers} and d_model {other.d_model}, lens 0 "
                                  f"{first.source_layers} and {first.d_model}", code="jacobian_merge_mismatch",
                                  remedy="merge lenses fitted with the same layers on the same model")
            theirs = {k: v for k, v in other.metadata.items() if k not in NOT_PROVENANCE}
            if theirs != prov:
                diff = sorted(k for k in set(prov) | set(theirs) if prov.get(k) != theirs.get(k))
                raise ConfigError(f"lens {i}'s provenance differs from lens 0's in {', '.join(diff)}",
                                  code="jacobian_merge_mismatch",
                                  remedy="merge only shards fitted with the same model, settings and corpus name")
        total = sum(x.n_prompts for x in lenses)
        mats = {L: (sum(x.jacobians[L].double() * x.n_prompts for x in lenses) / total).float()
                for L in first.source_layers}
        meta = dict(first.metadata, n_prompts=total) if first.metadata else {}
        return cls(mats, n_prompts=total, d_model=first.d_model, metadata=meta)
