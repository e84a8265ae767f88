"""Results: tidy tables, offline HTML pages and manifests."""

from .manifest import build_manifest, package_versions
from .result import Result

__all__ = ["Result", "build_manifest", "package_versions"]
