"""ProbeFit: everything a probe fit produced, per fold and site, and its table and saved form.

Shapes: F folds (1 for a holdout split), S sites, D features, K' = 1 (binary classification,
regression) or K (multi-class: one vector per class, sklearn's symmetric parameterisation).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

FORMAT = "entoscope.probe/1"


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)


def _mean_std(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sample std (ddof=1) over folds (dim 0); the std is NaN for one fold."""
    if v.shape[0] == 1:
        return v[0], torch.full_like(v[0], float("nan"))
    return v.mean(0), v.std(0, correction=1)


@dataclass
class ProbeFit:
    task: str  # "classification" | "regression"
    site_names: list[str]
    classes: list | None  # class labels in code order (classification)
    split: str  # "holdout" | "kfold" | "given"
    seed: int
    grid_name: str  # "C" (logistic) or "alpha" (ridge)
    grid: list[float]  # strongest regularisation first
    test: dict[str, torch.Tensor]  # held-out metrics [F, S]: the result
    val: dict[str, torch.Tensor]  # validation metrics of the chosen probe [F, S] (used to choose)
    train: dict[str, torch.Tensor]  # training-set metrics [F, S]: NOT a result (memorisation)
    control_test: dict[str, torch.Tensor] | None  # held-out metrics of the control probe [F, S]
    control_train: dict[str, torch.Tensor] | None
    control: str | None  # "shuffle" | "groups" | None
    chosen: torch.Tensor  # [F, S] chosen C / alpha
    control_chosen: torch.Tensor | None  # [F, S]
    coef: torch.Tensor  # [F, S, K', D] weights on standardised features
    intercept: torch.Tensor  # [F, S, K']
    mean: torch.Tensor  # [F, S, D] training-row mean per fold
    std: torch.Tensor  # [F, S, D] training-row std per fold
    converged: torch.Tensor  # [F, S] every chosen fit met its gradient test
    chance_accuracy: torch.Tensor | None  # [F] test accuracy of always answering the majority training class
    splits: list = field(default_factory=list, repr=False)  # the Split objects (row indices)
    control_coef: torch.Tensor | None = None  # [F, S, K', D] the control probe's weights (standardised features)
    control_intercept: torch.Tensor | None = None  # [F, S, K']
    control_labels: torch.Tensor | None = None  # [N] the control task's label codes

    # ---- derived quantities -------------------------------------------------------------
    @property
    def n_folds(self) -> int:
        return int(self.coef.shape[0])

    @property
    def primary_metric(self) -> str:
        return "accuracy" if self.task == "classification" else "r2"

    @property
    def raw_coef(self) -> torch.Tensor:
        """[F, S, K', D]: the fitted linear map on raw activations (w / std)."""
        return self.coef / self.std[:, :, None, :]

    @property
    def raw_intercept(self) -> torch.Tensor:
        """[F, S, K']: intercepts matching `raw_coef` (b - (w / std) . mean)."""
        return self.intercept - torch.einsum("fskd,fsd->fsk", self.raw_coef, self.mean)

    def raw_map(self, control: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw_coef, raw_intercept) of the probe, or of the control probe (same standardisation)."""
        if not control:
            return self.raw_coef, self.raw_intercept
        if self.control_coef is None or self.control_intercept is None:
            raise ValueError("this fit has no control probe")
        coef = self.control_coef / self.std[:, :, None, :]
        return coef, self.control_intercept - torch.einsum("fskd,fsd->fsk", coef, self.mean)

    @property
    def fold_directions(self) -> torch.Tensor:
        """[F, S, K', D] unit raw-space directions, one per fold."""
        return _unit(self.raw_coef)

    @property
    def directions(self) -> torch.Tensor:
        """[S, K', D] unit raw-space direction per site (the normalised mean over folds)."""
        return _unit(self.fold_directions.mean(0))

    @property
    def direction_agreement(self) -> torch.Tensor:
        """[S]: mean pairwise cosine of the fold directions (averaged over K'); NaN for one fold."""
        u = self.fold_directions  # [F, S, K', D]
        F = u.shape[0]
        if F < 2:
            return torch.full(u.shape[1:2], float("nan"), dtype=u.dtype)
        cos = torch.einsum("fskd,gskd->sfgk", u, u)  # [S, F, F, K']
        off = ~torch.eye(F, dtype=torch.bool)
        return cos[:, off].mean((-1, -2))

    @property
    def selectivity(self) -> torch.Tensor | None:
        """[F, S]: held-out primary metric (accuracy / R^2) of the probe minus the control's."""
        if self.control_test is None:
            return None
        m = self.primary_metric
        return self.test[m] - self.control_test[m]

    # ---- tables --------------------------------------------------------------------------
    def to_frame(self, per_fold: bool = False) -> pd.DataFrame:
        """One row per site (per_fold=False: mean over folds plus `_std`, the sample std over
        folds, NaN for a holdout split) or one row per site and fold (per_fold=True).

        test_*: held-out metrics (the result). control_test_*: the control probe's. selectivity:
        test minus control on the primary metric. train_*: scores on the training rows, a
        measure of fit, not of the property. C / alpha: chosen on validation rows (median over
        folds). converged: every chosen fit met its gradient test.
        """
        cols: dict[str, torch.Tensor] = {}
        for m, v in self.test.items():
            cols[f"test_{m}"] = v
        if self.control_test is not None:
            cols["selectivity"] = self.selectivity
            for m, v in self.control_test.items():
                cols[f"control_test_{m}"] = v
        for m, v in self.train.items():
            cols[f"train_{m}"] = v
        F, S = self.chosen.shape
        if per_fold:
            rows = {
                "site": [n for _ in range(F) for n in self.site_names],
                "fold": [f for f in range(F) for _ in range(S)],
            }
            for c, v in cols.items():
                rows[c] = v.reshape(-1).tolist()
            rows[self.grid_name] = self.chosen.reshape(-1).tolist()
            if self.chance_accuracy is not None:
                rows["chance_accuracy"] = self.chance_accuracy[:, None].expand(F, S).reshape(-1).tolist()
            rows["converged"] = self.converged.reshape(-1).tolist()
            return pd.DataFrame(rows)
        rows = {"site": list(self.site_names), "n_folds": [F] * S}
        for c, v in cols.items():
            mu, sd = _mean_std(v.to(torch.float64))
            rows[c] = mu.tolist()
            if not c.startswith("train_"):
                rows[f"{c}_std"] = sd.tolist()
        rows[self.grid_name] = self.chosen.median(0).values.tolist() if F > 1 else self.chosen[0].tolist()
        if self.chance_accuracy is not None:
            rows["chance_accuracy"] = [float(self.chance_accuracy.mean())] * S
        if F > 1:
            rows["direction_agreement"] = self.direction_agreement.tolist()
        rows["converged"] = self.converged.all(0).tolist()
        return pd.DataFrame(rows)

    # ---- saving --------------------------------------------------------------------------
    def metadata(self) -> dict:
        def mean_only(d):
            return None if d is None else {m: _mean_std(v.to(torch.float64))[0].tolist() for m, v in d.items()}

        return {
            "format": FORMAT,
            "task": self.task,
            "site_names": list(self.site_names),
            "classes": None if self.classes is None else [_jsonable(c) for c in self.classes],
            "split": self.split,
            "n_folds": self.n_folds,
            "seed": self.seed,
            "grid_name": self.grid_name,
            "grid": [float(c) for c in self.grid],
            "control": self.control,
            "test_mean": mean_only(self.test),
            "control_test_mean": mean_only(self.control_test),
            "selectivity_mean": None if self.selectivity is None else _mean_std(self.selectivity)[0].tolist(),
            "direction_convention": "directions[s] are unit vectors in the raw activation basis "
            "(w / std, normalised); binary: one vector pointing to the positive class (classes[1]); "
            "multi-class: one per class; regression: increasing the target",
        }

    def save_directions(self, path: str | Path) -> Path:
        """Write `path` (.safetensors: directions and the full linear maps) and `path`.json (metadata)."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        tensors = {
            "directions": self.directions,
            "raw_coef": self.raw_coef,
            "raw_intercept": self.raw_intercept,
            "coef": self.coef,
            "intercept": self.intercept,
            "mean": self.mean,
            "std": self.std,
            "chosen": self.chosen,
        }
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = self.metadata()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"entoscope": json.dumps(meta, default=str)})
        path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return path


@dataclass
class ProbeDirections:
    """What `load_directions` returns: the saved tensors (see ProbeFit) and the metadata dict."""

    directions: torch.Tensor  # [S, K', D]
    raw_coef: torch.Tensor  # [F, S, K', D]
    raw_intercept: torch.Tensor  # [F, S, K']
    coef: torch.Tensor
    intercept: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    chosen: torch.Tensor
    meta: dict

    @property
    def site_names(self) -> list[str]:
        return list(self.meta["site_names"])

    def direction(self, site: str | int) -> torch.Tensor:
        """[K', D] unit direction(s) of one site, by name or index."""
        i = self.site_names.index(site) if isinstance(site, str) else int(site)
        return self.directions[i]


def load_directions(path: str | Path) -> ProbeDirections:
    """The directions `ProbeFit.save_directions` wrote, read behind entoscope.files' checks (a truncated,
    damaged or foreign file, missing tensors or metadata, non-finite directions: `tensor_file_invalid`)."""
    from ..errors import DataError
    from ..files import read_tensors

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")

    def refuse(message: str) -> DataError:
        return DataError(message, code="tensor_file_invalid", remedy="save the probe's directions again "
                         "(ProbeFit.save_directions), or copy the file again")

    t, metadata = read_tensors(path, refuse=refuse, floating=False, finite=False)
    keys = ("directions", "raw_coef", "raw_intercept", "coef", "intercept", "mean", "std", "chosen")
    missing = [k for k in keys if k not in t]
    if missing:
        raise refuse(f"{path} is not a file of probe directions (no {', '.join(missing)})")
    try:
        meta = json.loads(metadata["entoscope"])
    except (KeyError, ValueError) as err:
        raise refuse(f"{path} has no readable entoscope metadata ({type(err).__name__})") from None
    if not t["directions"].is_floating_point() or not bool(torch.isfinite(t["directions"]).all()):
        raise refuse(f"{path}: the directions hold NaN, inf or non-float values")
    return ProbeDirections(meta=meta, **{k: t[k] for k in keys})


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
