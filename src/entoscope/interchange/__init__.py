"""Interchange interventions on subspaces and distributed alignment search (docs/interchange.md)."""

from .operation import Interchange

__all__ = ["Interchange"]
