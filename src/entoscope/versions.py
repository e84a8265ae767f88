"""Installed versions of packages, read from their `NAME-VERSION.dist-info` folders on sys.path: a directory
listing, where importlib.metadata's import and lookups cost tens of milliseconds (`entoscope --version`
and every run's manifest ask for several)."""

from __future__ import annotations

import functools
import os
import re
import sys


def installed_version(dist: str) -> str | None:
    """`dist`'s version (the first on sys.path, as importlib.metadata finds it), or None if not installed."""
    version = _dist_info_versions().get(_normal(dist))
    if version is not None:
        return version
    import importlib.metadata as md  # an egg-info or other install: the slow, general way

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@functools.cache
def _dist_info_versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for name in listing:
            if name.endswith(".dist-info") and "-" in name:
                stem, version = name[: -len(".dist-info")].split("-", 1)
                found.setdefault(_normal(stem), version)
    return found
