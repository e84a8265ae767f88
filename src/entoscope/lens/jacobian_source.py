"""Where an operation's Jacobian lens comes from: a fitted file (`lens`), or a small fit made in the run itself
on `fit_data` (the built-in corpus by default), for the lens comparison and coordinate patching.

A fit made here is `JacobianLensFit` with `fit_skip_first` and `fit_max_length`, prepared with the operation
(its prompts checked, its forward and backward passes in the operation's plan) and run before the operation's
own forwards; the page says which lens was read (`source_note`). A lens fitted on so few texts is noisy (its
split-half change is in the fit's table): fit one on more texts with `entoscope train-lens --method jacobian`
and pass it as `lens` for numbers to rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ..config_model import ConfigModel
from ..data.loading import load_data
from ..errors import ConfigError
from ..models.adapter import ModelAdapter
from ..prepared import Prepared
from .jacobian import JacobianLens

DEFAULT_FIT_DATA = {"task": "corpus", "n": 4, "seed": 0}


class JacobianSource(ConfigModel):
    """The fields that say which Jacobian lens an operation reads (a mixin of operations)."""

    lens: str | None = Field(default=None, description="a fitted Jacobian lens: its .pt file or folder (ours, "
                             "TransformerLens 4.3's); none: one is fitted in the run on fit_data")
    fit_data: dict[str, Any] | list[str] | None = Field(
        default_factory=lambda: dict(DEFAULT_FIT_DATA),
        description="texts a Jacobian lens is fitted on when `lens` is not given (null: none is fitted)")
    fit_skip_first: int = Field(default=4, ge=0, description="the fit's leading positions left out (attention sinks)")
    fit_max_length: int = Field(default=48, ge=2, description="the fit's texts cut to this many tokens")


@dataclass(frozen=True)
class LensSource:
    """The lens a run reads: loaded (`lens`), or to be fitted in the run (`fit`: the fit's prepared run)."""

    lens: JacobianLens | None
    fit: Prepared[Any] | None
    note: str
    fit_op: Any = None  # the JacobianLensFit that `fit` was prepared by

    def resolve(self, quiet: bool = True) -> JacobianLens | None:
        """The lens: the loaded one, or the fit run now (its forwards and backwards are in the plan)."""
        if self.fit is None:
            return self.lens
        lens: JacobianLens = self.fit_op.execute(self.fit, quiet=quiet).extra["lens"]
        lens.check_model(self.fit.model)
        return lens

    @property
    def forward_passes(self) -> int:
        return 0 if self.fit is None else self.fit.plan.forward_passes

    @property
    def backward_passes(self) -> int:
        return 0 if self.fit is None else self.fit.plan.backward_passes


def prepare_source(op: JacobianSource, model: ModelAdapter, *, required: bool, layers: list[int] | None = None
                   ) -> LensSource:
    """The lens `op` names, loaded and checked against the model, or its fit prepared (prompts checked, nothing
    run; a fit is made for `layers`, default every layer but the last); with neither `lens` nor `fit_data`, no
    lens (refused when `required`)."""
    if op.lens is not None:
        lens = JacobianLens.load(op.lens)
        lens.check_model(model)
        return LensSource(lens, None, f"the Jacobian lens read from {op.lens} ({lens.n_prompts} prompts)")
    if op.fit_data is None:
        if required:
            raise ConfigError("this operation reads a Jacobian lens, and neither lens nor fit_data is given",
                              code="jacobian_lens_missing", remedy="pass lens: FILE (entoscope train-lens --method "
                              "jacobian) or fit_data: {task: corpus, n: 4}")
        return LensSource(None, None, "")
    from .jacobian_fit import JacobianLensFit

    fit = JacobianLensFit(layers=layers, skip_first=op.fit_skip_first, max_length=op.fit_max_length,
                          memory=getattr(op, "memory", "auto"),
                          prepend_bos=getattr(op, "prepend_bos", True))
    # texts are only text: built without the model's tokenizer, so a task's answer words need not be one token
    data = load_data(op.fit_data)
    prepared = fit.prepare(model, data)
    n = prepared.plan.examples
    return LensSource(None, prepared, f"a Jacobian lens fitted in this run on only {n} text{'s' * (n != 1)} "
                      f"({_spec_text(op.fit_data)}, cut to {op.fit_max_length} tokens, skip_first "
                      f"{op.fit_skip_first}): a noisy lens; pass `lens` for one fitted on more texts", fit)


def _spec_text(spec: Any) -> str:
    if isinstance(spec, dict):
        return ", ".join(f"{k}: {v}" for k, v in spec.items())
    return "texts given"
