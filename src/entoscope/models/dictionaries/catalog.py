"""Finding a dictionary by name: the bundled demo ones, folders on disk, and names registered from Python.

A dictionary spec (what `Sites(dictionary=...)` holds) is one of:
- a registered name (`entoscope.dictionaries.register_dictionary("mine", sae)`), e.g. an sae_lens SAE;
- `demo/<name>`: one of the dictionaries bundled for the demo model (`demo/resid_post.1`, `demo/transcoder.1`);
- a path to a SAELens folder (cfg.json + sae_weights.safetensors);
- a *release*: `demo`, or a folder whose sub-folders are SAELens folders; then the dictionary is the one
  that writes the site asked for (`for_site`).
Loaded folders are kept (keyed by their resolved path and modification time), so a run loads each once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import DictionaryError
from ...registry import lookup, names, register
from .dictionary import Dictionary
from .saelens import from_sae_lens, is_folder, read_folder

DEMO = Path(__file__).resolve().parents[2] / "demo" / "dictionaries"
_LOADED: dict[tuple[str, float], Dictionary] = {}


def register_dictionary(name: str, dictionary: Any, *, replace: bool = False) -> Dictionary:
    """Make a Dictionary (or an sae_lens SAE / Transcoder object) usable by name in sites and YAML."""
    d = as_dictionary(dictionary, name)
    d.name = name
    register("dictionary", name, replace=replace)(d)
    return d


def as_dictionary(obj: Any, name: str = "") -> Dictionary:
    if isinstance(obj, Dictionary):
        return obj
    if hasattr(obj, "W_enc") and hasattr(obj, "cfg") and hasattr(obj, "state_dict"):
        return from_sae_lens(obj, name)
    raise DictionaryError(f"{type(obj).__name__} is not a dictionary", code="dictionary_not_found",
                          remedy="pass an entoscope Dictionary, an sae_lens SAE, or a SAELens folder")


def _path(spec: str) -> Path:
    if spec == "demo":
        return DEMO
    if spec.startswith("demo/"):
        return DEMO / spec[len("demo/"):]
    return Path(spec).expanduser()


def get_dictionary(spec: str | Dictionary) -> Dictionary:
    """The dictionary a spec names (one dictionary, not a release)."""
    if isinstance(spec, Dictionary):
        return spec
    if spec in names("dictionary"):
        return lookup("dictionary", spec)
    path = _path(spec)
    if not is_folder(path):
        hint = (f"; {spec} is a release: name one of {', '.join(release_members(spec))}"
                if is_release(spec) else "")
        raise DictionaryError(f"no dictionary {spec!r}{hint}", code="dictionary_not_found",
                              remedy="give a registered name, demo/<name> (bundled: "
                              f"{', '.join('demo/' + m for m in release_members('demo')) or 'none installed'}), "
                              "or a SAELens folder (cfg.json + sae_weights.safetensors)")
    key = (str(path.resolve()), (path / "sae_weights.safetensors").stat().st_mtime)
    if key not in _LOADED:
        _LOADED[key] = read_folder(path, name=spec)
    return _LOADED[key]


def is_release(spec: str) -> bool:
    path = _path(spec)
    return spec not in names("dictionary") and path.is_dir() and not is_folder(path) and bool(release_members(spec))


def release_members(spec: str) -> list[str]:
    path = _path(spec)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.is_dir() and is_folder(p))


def for_site(spec: str | Dictionary, site: str) -> tuple[str, Dictionary]:
    """(key, dictionary) of the dictionary that writes `site` (a canonical name such as resid_post.1).

    A single dictionary must write that site; in a release, exactly one member must."""
    if isinstance(spec, Dictionary) or not is_release(spec):
        d = get_dictionary(spec)
        key = spec if isinstance(spec, str) else (d.name or "dictionary")
        if d.hook_out != site:
            raise DictionaryError(f"dictionary {key!r} writes {d.hook_out} (reads {d.hook_in}), not {site}",
                                  code="dictionary_site_mismatch",
                                  remedy=f"use activation {d.hook_out.split('.')[0]} and layer(s) "
                                  f"{d.hook_out.split('.')[-1]} with this dictionary, or another dictionary")
        return key, d
    found = writers(spec, site)
    if len(found) != 1:
        what = "no dictionary" if not found else f"{len(found)} dictionaries ({', '.join(k for k, _ in found)})"
        raise DictionaryError(f"release {spec!r} has {what} writing {site}", code="dictionary_site_mismatch"
                              if not found else "dictionary_ambiguous",
                              remedy=f"name one dictionary: {', '.join(f'{spec}/{m}' for m in release_members(spec))}")
    return found[0]


def writers(release: str, site: str) -> list[tuple[str, Dictionary]]:
    """(key, dictionary) of every member of a release that writes `site`."""
    members = ((f"{release.rstrip('/')}/{m}", get_dictionary(f"{release.rstrip('/')}/{m}"))
               for m in release_members(release))
    return [(key, d) for key, d in members if d.hook_out == site]
