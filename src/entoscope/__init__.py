"""entoscope: mechanistic interpretability of language models, over datasets, with numbers you can check."""

from .errors import EntoscopeError
from .models import ActName, Intervention, ModelAdapter, adapt, load_model

__version__ = "0.1.0.dev0"
__all__ = ["ActName", "EntoscopeError", "Intervention", "ModelAdapter", "adapt", "load_model"]
