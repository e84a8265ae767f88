"""Inspect one prompt: what the model does there, token by token and head by head (`es.inspect`, docs/inspect.md)."""

from .operation import Inspect, inspect
from .result import InspectResult

__all__ = ["Inspect", "InspectResult", "inspect"]
