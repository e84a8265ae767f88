"""The one small interface every kind of model sits behind, and the list of kinds.

`ModelAdapter` (adapter.py) speaks canonical activation names to operations; a `Backend` does the
model-specific part: it describes the model (`structure`, `weights`), says which sites it can serve,
and runs forwards that read base sites and apply interventions at base sites (`run`). Derived sites
(`result`, `features.L@KEY`, norms a model lacks) are lowered to base sites by the adapter, so a
backend never sees them.

A site is read and written in its canonical layout (names.KINDS). Interventions at one site apply
in the order given, and a read at that site sees the value after them.

Adding a kind of model is one file: a `Backend` subclass, listed in `backend_classes()` below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor

from ..errors import UnsupportedModelError
from .names import ActName
from .structure import Structure
from .weights import Weights

SiteFn = Callable[[Tensor], Tensor | None]  # None: leave the value as it is
BaseIntervention = tuple[ActName, SiteFn]


class Backend:
    """One kind of model. Subclasses set `name` and implement the methods below."""

    name: ClassVar[str]
    module: Any      # the torch module that holds the weights (parameters, eval mode, entoscope's marks)
    runner: Any      # what cached reads call: run_with_cache(tokens, names_filter=[keys], return_type="logits", ...)

    @classmethod
    def accepts(cls, model: Any) -> bool:
        raise NotImplementedError

    # --- what the model is
    def structure(self) -> Structure:
        raise NotImplementedError

    def weights(self, structure: Structure) -> Weights:
        raise NotImplementedError

    @property
    def tokenizer(self) -> Any:
        raise NotImplementedError

    @property
    def model_name(self) -> str:
        raise NotImplementedError

    def check_sites(self, structure: Structure) -> None:
        """Refuse at load time a model whose sites do not carry what the layer needs."""

    def check_servable(self, act: ActName) -> None:
        """Refuse (SiteError) a base site this model cannot read or write."""

    def written_through(self, act: ActName) -> ActName:
        """The base site where a write to `act` takes effect (itself, unless the backend writes it elsewhere)."""
        return act

    def computes_norm(self, act: ActName, structure: Structure) -> bool:
        """Whether the normalised input `act` has no site here, so the adapter computes it from the residual."""
        return False

    def has_site(self, act: ActName) -> bool:
        raise NotImplementedError

    def sites(self, structure: Structure) -> list[ActName]:
        """Every base site this model has, in the order a forward reaches them (where a NaN is looked for)."""
        raise NotImplementedError

    # --- runs
    def key(self, act: ActName) -> str:
        """The name a read is cached under (the runner's names_filter)."""
        raise NotImplementedError

    def keeps_last_logits(self) -> bool:
        """Whether the forward can unembed only its last positions (`logits_to_keep`)."""
        return False

    def run(self, tokens: Tensor, reads: Sequence[ActName], interventions: Sequence[BaseIntervention], *,
            logits: bool = True) -> tuple[Tensor | None, dict[ActName, Tensor]]:
        """One uncached forward in the current grad mode: (logits or None, the reads)."""
        raise NotImplementedError

    def final_residual(self, tokens: Tensor, interventions: Sequence[BaseIntervention]) -> Tensor:
        """The last block's output [B, T, d_model] of a forward with `interventions` (nothing after it runs)."""
        raise NotImplementedError

    def final_norm(self, x: Tensor) -> Tensor:
        """The model's own final norm applied to residuals [..., d_model]."""
        raise NotImplementedError

    logit_softcap: float = -1.0

    def attention_scale(self, structure: Structure) -> float:
        """The divisor of q.k in the attention scores."""
        return structure.d_head ** 0.5

    def activation_cache(self, acts: Mapping[ActName, Tensor]) -> Any:
        """A TransformerLens ActivationCache of canonical activations under this model's hook names (tracing.py's
        `Trace.to_activation_cache`); refused where the model has no TransformerLens hook names."""
        raise UnsupportedModelError(
            f"a {self.name} model has no TransformerLens hook names to key an ActivationCache by",
            code="activation_cache_unavailable",
            remedy="read the trace by entoscope's names (trace['resid_post.3']; docs/migration.md maps them to module "
            "paths), or load the model as a TransformerBridge (es.load_model(name)) for TransformerLens's names")

    # --- runs that start part-way (partial.py)
    def prefix_support(self, structure: Structure) -> str:
        return "none"

    def prefix_note(self, structure: Structure) -> str:
        return ""

    def start_paths(self) -> dict[str, str]:
        """How runs starting at a layer (and position) are made, for the plan's notes."""
        return {"positions": "", "layers": ""}

    def close(self) -> None:
        """Nothing to release by default."""


def backend_classes() -> list[type[Backend]]:
    from .nnsight_backend import NNsightBackend
    from .tl_backend import BridgeBackend, HookedBackend

    return [BridgeBackend, HookedBackend, NNsightBackend]


def backend_for(model: Any) -> Backend:
    """The backend of an accepted model (not wrapped: the adapter unwraps CachedModel first)."""
    for cls in backend_classes():
        if cls.accepts(model):
            return cls(model)
    raise UnsupportedModelError(
        f"entoscope accepts a TransformerLens TransformerBridge or HookedTransformer, or an nnsight LanguageModel "
        f"(optionally in entoscope.CachedModel), not {type(model).__module__}.{type(model).__name__}",
        remedy="wrap a HuggingFace model first: TransformerBridge.boot_transformers(name), "
        "nnsight.LanguageModel(hf_model, tokenizer=...), or entoscope.load_model(name)",
    )


def backend_name(model: Any) -> str:
    """"bridge", "hooked" or "nnsight" for an accepted model (or the runner of one); refuses anything else."""
    for cls in backend_classes():
        if cls.accepts(model):
            return cls.name
    runner_of = getattr(model, "_entoscope_backend", None)
    if isinstance(runner_of, str):
        return runner_of
    backend_for(model)  # raises the refusal
    raise AssertionError
