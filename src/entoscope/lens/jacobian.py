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
convention); on a compat bridge or a processed HookedTransformer the stream is centred and the norms folded,
so the matrices differ. The metadata records the mode and a lens is refused on a model of the other basis
(raw: a plain bridge, an nnsight model, an unprocessed HookedTransformer; folded: a compat bridge, a
processed HookedTransformer).

Which model: entoscope's fits record the weights' fingerprint (`entoscope_weights`: models/fingerprint.py's
`weights_fingerprint`, the canonical weights' bytes), and a lens is refused on a model whose weights differ (a
model of the same shape fitted or seeded otherwise, another dtype) whatever its name; the same checkpoint loaded
another way in the same basis passes (a plain bridge and an nnsight model; a compat bridge and a processed
HookedTransformer, whose folded weights are the same bytes). A lens without the fingerprint (TransformerLens's
own) is checked as TransformerLens checks it: its `model_name` (and `model_revision`) against the model's.

Prompts: a fit records a 64-bit hash of each prompt's tokens (`prompt_hashes`, a top-level key
TransformerLens ignores); `merge` refuses lenses that share prompts, which it would count twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, ModelLoadError, warn
from ..models.adapter import ModelAdapter, adapt
from ..models.names import ActName

FILE = "lens.pt"
ESTIMATOR = "jacobian_lens"
# metadata keys that are not provenance: a merge may combine lenses that differ in them
NOT_PROVENANCE = ("n_prompts",)
# the residual basis of each structure.mode: a lens reads only a model of the basis it was fitted in
BASIS = {"plain": "raw", "unprocessed": "raw", "compat": "folded", "processed": "folded"}


class JacobianLens:
    """Fitted transport matrices {source layer: [d_model, d_model]} (float32, CPU), the prompt count, the
    provenance (`metadata`) and, when fitted here, each layer's settledness (relative change of J[l]
    between the even- and odd-numbered prompts; `JacobianLensFit`)."""

    def __init__(self, jacobians: dict[int, Tensor], *, n_prompts: int, d_model: int,
                 metadata: dict[str, Any] | None = None, settledness: dict[int, float] | None = None,
                 prompt_hashes: Tensor | None = None) -> None:
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
        if prompt_hashes is not None and tuple(prompt_hashes.shape) != (self.n_prompts,):
            raise ConfigError(f"{tuple(prompt_hashes.shape)} prompt hashes for {self.n_prompts} prompts",
                              code="jacobian_lens_corrupt", remedy="fit the lens again")
        self.prompt_hashes = None if prompt_hashes is None else prompt_hashes.to(torch.int64).cpu()
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
        """Refuse a model this lens cannot read (`jacobian_lens_mismatch`): another width or depth, another
        target layer, another residual basis, or other weights (the module docstring)."""
        s = model.structure
        bad = s.d_model != self.d_model or any(not 0 <= L < s.n_layers - 1 for L in self.jacobians)
        mode = str(self.metadata.get("entoscope_mode", "plain"))
        self.target = s.n_layers - 1
        if bad:
            raise ConfigError(f"this lens is for d_model {self.d_model} and layers {self.source_layers}; the model "
                              f"has d_model {s.d_model} and {s.n_layers} layers", code="jacobian_lens_mismatch",
                              remedy="fit a Jacobian lens for this model (entoscope train-lens --method jacobian)")
        target = self.metadata.get("target_layer", s.n_layers - 1)
        if target != s.n_layers - 1:
            raise ConfigError(f"this lens targets layer {target}, not the model's last ({s.n_layers - 1})",
                              code="jacobian_lens_mismatch", remedy="fit the lens on this model")
        if BASIS.get(mode, mode) != BASIS.get(s.mode, s.mode):
            raise ConfigError(f"this lens was fitted on a {mode} model; this one is {s.mode} (another residual basis)",
                              code="jacobian_lens_mismatch",
                              remedy="load the model the way it was loaded for the fit, or fit the lens again")
        self._check_identity(model)

    def _check_identity(self, model: ModelAdapter) -> None:
        from ..models.fingerprint import weights_fingerprint

        meta = self.metadata
        theirs = meta.get("entoscope_weights")
        recorded = f"{meta.get('model_name')!r}"
        remedy = ("fit a Jacobian lens on this model (entoscope train-lens --method jacobian), or load the model the "
                  "lens was fitted on")
        if theirs is not None:
            mine = weights_fingerprint(model)
            if mine is not None and mine != theirs:
                dtype = str(next(model.module.parameters()).dtype).removeprefix("torch.")
                raise ConfigError(f"this lens was fitted on other weights: it records model {recorded} (weights "
                                  f"{str(theirs)[:12]}, {meta.get('fit_dtype')}); this model is {model.name!r} "
                                  f"(weights {mine[:12]}, {dtype})", code="jacobian_lens_mismatch",
                                  remedy=remedy + " (the same checkpoint in the same dtype)")
            return
        for key, here in (("model_name", model.name), ("model_revision", _revision(model))):
            there = meta.get(key)
            if there is not None and here and there != here:
                raise ConfigError(f"this lens records {key} {there!r}; this model's is {here!r} (a lens fitted "
                                  "elsewhere records no weights fingerprint, so its name is compared)",
                                  code="jacobian_lens_mismatch",
                                  remedy=remedy + f"; if it is the same model, set lens.metadata[{key!r}] and save it")

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
        if self.prompt_hashes is not None:
            payload["prompt_hashes"] = self.prompt_hashes
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
        try:
            return cls._from_payload(payload)
        except (ConfigError, ValueError, TypeError) as err:
            why = err.message if isinstance(err, ConfigError) else str(err)
            raise ModelLoadError(f"{p}: {why}", **corrupt) from None

    @classmethod
    def _from_payload(cls, payload: dict[str, Any]) -> JacobianLens:
        """A lens from a loaded file's dict; every field checked for its type (ValueError naming it)."""
        metadata = payload.get("metadata")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
            raise ValueError(f"its metadata is a {type(metadata).__name__}, not a mapping of names to values")
        if "J" in payload:
            mats, n = payload["J"], _whole(payload.get("n_prompts", 0), "n_prompts")
        else:
            n = _whole(payload.get("n_done", payload.get("n_prompts", 0)), "n_done")
            if n <= 0:
                raise ValueError(f"it is a fit checkpoint with n_done={n}")
            sums = payload["jacobian_sum"]
            if not isinstance(sums, dict) or not all(torch.is_tensor(v) for v in sums.values()):
                raise ValueError("its jacobian_sum is not a mapping of layer -> tensor")
            mats = {k: v.float() / n for k, v in sums.items()}
            if "target_layer" in payload:
                metadata = dict(metadata, target_layer=payload["target_layer"])
        if not isinstance(mats, dict) or not mats or not all(torch.is_tensor(v) and v.ndim == 2 for v in mats.values()):
            raise ValueError("its matrices are not a mapping of layer -> [d, d] tensors")
        mats = {_layer(k): v for k, v in mats.items()}
        if not all(bool(torch.isfinite(v.float()).all()) for v in mats.values()):
            raise ValueError("its matrices hold NaN or inf")
        if n < 0:
            raise ValueError(f"n_prompts is {n}")
        if metadata.get("target_layer") is not None:
            metadata = dict(metadata, target_layer=_whole(metadata["target_layer"], "target_layer", tensor=False))
        d_model = _whole(payload["d_model"], "d_model") if "d_model" in payload else next(iter(mats.values())).shape[0]
        settledness = payload.get("settledness")
        if settledness is not None:
            if not isinstance(settledness, dict):
                raise ValueError(f"its settledness is a {type(settledness).__name__}, not a mapping of layer -> number")
            settledness = {_layer(k): float(v) for k, v in settledness.items()}
        hashes = payload.get("prompt_hashes")
        if hashes is not None and not (torch.is_tensor(hashes) and hashes.dtype == torch.int64 and hashes.ndim == 1):
            raise ValueError("its prompt_hashes are not a 1-D int64 tensor")
        return cls(mats, n_prompts=n, d_model=d_model, metadata=metadata, settledness=settledness,
                   prompt_hashes=hashes)

    @classmethod
    def merge(cls, lenses: Sequence[JacobianLens]) -> JacobianLens:
        """Lenses fitted on disjoint prompts as one: each layer's matrices averaged weighted by the prompt
        counts (sums in float64). Refused unless the lenses agree on layers, d_model and every provenance
        field but the prompt count (model, mode, corpus, estimator settings), and when two of them share
        prompts (their `prompt_hashes`; the same lens twice): those would be counted twice. Lenses without
        prompt hashes (TransformerLens's) cannot be checked for that: merged with a warning."""
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
        hashes = _disjoint_prompts(lenses)
        total = sum(x.n_prompts for x in lenses)
        mats = {L: (sum(x.jacobians[L].double() * x.n_prompts for x in lenses) / total).float()
                for L in first.source_layers}
        meta = dict(first.metadata, n_prompts=total) if first.metadata else {}
        return cls(mats, n_prompts=total, d_model=first.d_model, metadata=meta, prompt_hashes=hashes)


def _disjoint_prompts(lenses: Sequence[JacobianLens]) -> Tensor | None:
    """The merged lens's prompt hashes; refused where two lenses share prompts; None (with a warning) where a lens
    records none."""
    if any(x.prompt_hashes is None for x in lenses):
        missing = [i for i, x in enumerate(lenses) if x.prompt_hashes is None]
        warn(f"lens(es) {', '.join(map(str, missing))} record no prompt hashes (fitted elsewhere?): whether the "
             "lenses share prompts, which the merge would count twice, cannot be checked",
             code="jacobian_merge_unchecked")
        return None
    seen: list[set[int]] = []
    for i, x in enumerate(lenses):
        mine = set(x.prompt_hashes.tolist())  # type: ignore[union-attr]
        for j, theirs in enumerate(seen):
            shared = len(mine & theirs)
            if shared:
                same = " (the same lens twice?)" if mine == theirs else ""
                raise ConfigError(f"lens {i} shares {shared} of its {x.n_prompts} prompts with lens {j}{same}: the "
                                  "merge would count them twice", code="jacobian_merge_mismatch",
                                  remedy="merge lenses fitted on disjoint prompts (shards of a corpus, each fitted once)")
        seen.append(mine)
    return torch.cat([x.prompt_hashes for x in lenses])  # type: ignore[misc]


def prompt_hash(ids: Sequence[int]) -> int:
    """A prompt's 64-bit hash (signed, for an int64 tensor): the first 8 bytes of SHA-256 of its token ids."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256(np.asarray(list(ids), dtype=np.int64).tobytes()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _whole(value: Any, name: str, tensor: bool = True) -> int:
    """A whole number from a file (an int, an integral float, a 0-d integer tensor); ValueError naming the field."""
    if tensor and torch.is_tensor(value) and value.ndim == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{name} is {value!r} (a {type(value).__name__}), not a whole number")


def _layer(key: Any) -> int:
    """A layer number keying a file's mapping: an int, or its decimal text ('3')."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise ValueError(f"its matrices are keyed by {key!r}, not by layer numbers")


def _revision(model: ModelAdapter) -> str | None:
    """The HuggingFace commit the model was loaded at (None for a local folder or an in-memory model)."""
    module = model.module
    hf = getattr(getattr(module, "original_model", None), "config", None) or getattr(module, "config", None)
    revision = getattr(hf, "_commit_hash", None)
    return revision if isinstance(revision, str) and revision else None
