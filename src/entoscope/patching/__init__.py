"""Activation patching over datasets: exact (batched, prefix reuse), attribution, integrated gradients."""

from .operation import Patching
from .top import top_sites
from .values import PatchInputs, PatchValue, patch_value

__all__ = ["PatchInputs", "PatchValue", "Patching", "patch_value", "top_sites"]
