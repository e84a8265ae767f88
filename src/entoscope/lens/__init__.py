"""Lens: logit lens, tuned lens and parameter lens."""

from .operation import Lens
from .parameter import ParameterLens
from .tuned import TunedLens

__all__ = ["Lens", "ParameterLens", "TunedLens"]
