"""Lens: logit lens, tuned lens, Jacobian lens and parameter lens."""

from .jacobian import JacobianLens
from .operation import Lens
from .parameter import ParameterLens
from .tuned import TunedLens

__all__ = ["JacobianLens", "Lens", "ParameterLens", "TunedLens"]
