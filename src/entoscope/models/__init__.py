"""The model layer: the only part of entoscope that knows TransformerLens."""

from .adapter import Intervention, ModelAdapter, RunOutput, adapt
from .cached import CachedModel
from .loading import DEMO_DIR, from_hf, load_model
from .names import KINDS, ActName, parse_name
from .structure import Structure
from .weights import Norm, Weights

__all__ = ["ActName", "CachedModel", "DEMO_DIR", "Intervention", "KINDS", "ModelAdapter", "Norm", "RunOutput",
           "Structure", "Weights", "adapt", "from_hf", "load_model", "parse_name"]
