"""`DirectionSpec`: a direction as configuration (YAML, the command line, the manifest).

    source: mean_difference   data (pairs: each prompt minus its counterfactual), or data minus negative;
                              read_at (last, mean, a role); bos_in_mean (mean: count a leading BOS; default
                              no); pca: the top principal component (pairs)
                              -> made by the run itself, on the driver, from its own prompts
    source: probe             path (directions.safetensors of a Probing run), probe_site (its label), site
    source: feature           dictionary (demo/resid_post.1, a folder, a registered name), feature
    source: file              path (.npy / .safetensors), key, row, site
    source: vector            values, site (what a `Direction` made in Python becomes: its values and
                              provenance travel in the config, so the manifest repeats the run)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from ..config_model import ConfigModel
from ..data.loading import DataSpec
from ..errors import DataError
from ..models.adapter import ModelAdapter
from .direction import Direction

NEEDS = {"mean_difference": ("data",), "probe": ("path", "site"), "feature": ("dictionary", "feature"),
         "file": ("path", "site"), "vector": ("values", "site")}


class DirectionSpec(ConfigModel):
    """Where the steering direction comes from (see the module docstring)."""

    source: Literal["mean_difference", "probe", "feature", "file", "vector"] = Field(description="mean_difference "
        "(made by the run from data), probe, feature, file, or vector")
    site: str | None = Field(default=None, description="canonical site name (resid_pre.2); a feature's is its "
                             "dictionary's")
    head: int | None = Field(default=None, ge=0, description="the head (kv head for k / v) of a per-head site")
    data: DataSpec | None = Field(default=None, description="mean_difference: the prompts (with counterfactuals: "
                                  "pairs)")
    negative: DataSpec | None = Field(default=None, description="mean_difference: the prompts subtracted")
    read_at: str = Field(default="last", description="mean_difference: last, mean, or a role (END, YY, S2+1)")
    bos_in_mean: bool = Field(default=False, description="mean_difference, read_at mean: count a leading BOS in "
                              "the mean (default: left out)")
    pca: bool = Field(default=False, description="mean_difference: the top principal component of the paired "
                      "differences")
    path: str | None = Field(default=None, description="probe: a Probing run's directions.safetensors; file: a .npy "
                             "or .safetensors file")
    probe_site: str | None = Field(default=None, description="probe: the probed site's label (the table's site)")
    class_index: int | None = Field(default=None, ge=0, description="probe: which class's direction (multi-class)")
    dictionary: str | None = Field(default=None, description="feature: the dictionary (demo/resid_post.1, a folder, "
                                   "a registered name)")
    feature: int | None = Field(default=None, ge=0, description="feature: the feature's index")
    key: str | None = Field(default=None, description="file: the tensor's name in a .safetensors file")
    row: int | None = Field(default=None, description="file: the row of a 2-D array")
    values: list[float] | None = Field(default=None, description="vector: the direction's values (what an "
                                       "es.Direction made in Python becomes)")
    provenance: dict[str, Any] = Field(default_factory=dict, description="vector: where the values came from, kept "
                                       "in the manifest")

    @model_validator(mode="before")
    @classmethod
    def _from_direction(cls, value: Any) -> Any:
        return value.as_spec() if isinstance(value, Direction) else value

    @model_validator(mode="after")
    def _complete(self) -> DirectionSpec:
        missing = [k for k in NEEDS[self.source] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"source {self.source} needs {', '.join(missing)}")
        if self.source != "mean_difference" and (self.data is not None or self.negative is not None or self.pca):
            raise ValueError("data, negative and pca belong to source mean_difference")
        if self.source == "mean_difference" and self.site is None:
            raise ValueError("source mean_difference needs site")
        return self

    @property
    def made_by_run(self) -> bool:
        """The run makes the vector from its own prompts (a global step on the driver)."""
        return self.source == "mean_difference"

    def site_name(self) -> str:
        """The site the direction lives at (a feature's: the site its dictionary writes)."""
        if self.source == "feature":
            from ..models.dictionaries.catalog import get_dictionary
            from ..models.names import parse_name

            assert self.dictionary is not None
            return str(parse_name(get_dictionary(self.dictionary).hook_out))
        assert self.site is not None
        return self.site

    def resolve(self, model: ModelAdapter) -> Direction:
        """The direction, for every source but mean_difference (which the run makes)."""
        from .sources import from_feature, from_file

        if self.source == "vector":
            return Direction(self.site or "", torch.tensor(self.values, dtype=torch.float64), self.head,
                             dict(self.provenance) or {"source": "vector"})
        if self.source == "file":
            return from_file(self.path, self.site or "", key=self.key, row=self.row, head=self.head)
        if self.source == "feature":
            assert self.feature is not None
            return from_feature(self.dictionary, self.feature, model)
        if self.source == "probe":
            return self._probe()
        raise AssertionError("a mean difference is made by the run")

    def _probe(self) -> Direction:
        from pathlib import Path

        from ..probing.result import load_directions

        path = Path(self.path or "")
        if not path.is_file() and not path.with_name(path.name + ".safetensors").is_file():
            raise DataError(f"no probe directions at {self.path}", code="direction_file_missing",
                            remedy="give the directions.safetensors a Probing run saved")
        saved = load_directions(path)
        label = self.probe_site or saved.site_names[0]
        if label not in saved.site_names:
            raise DataError(f"the probe file has no site {label!r}", code="direction_probe",
                            remedy=f"its sites: {', '.join(saved.site_names[:12])}")
        dirs = saved.direction(label)
        k = self.class_index or 0
        if dirs.shape[0] > 1 and self.class_index is None or k >= dirs.shape[0]:
            raise DataError(f"the probe at {label} has {dirs.shape[0]} directions (one per class)",
                            code="direction_probe", remedy=f"give class_index: 0..{dirs.shape[0] - 1}")
        classes = saved.meta.get("classes") or []
        provenance = {"source": "probe", "path": str(self.path), "probe_site": label, "class_index": k,
                      "task": saved.meta.get("task"), "classes": [str(c) for c in classes]}
        return Direction(self.site or "", dirs[k].float(), self.head, provenance)

    def describe(self) -> str:
        if self.source == "mean_difference":
            what = "pairs (prompt - counterfactual)" if self.negative is None else "data - negative"
            return f"{'top principal component' if self.pca else 'mean difference'} of {what} at {self.site}, " \
                f"read at {self.read_at}"
        return f"{self.source} direction at {self.site_name()}"
