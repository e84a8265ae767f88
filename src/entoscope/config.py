"""YAML experiment files: named entries, each one operation's config plus its data.

    ioi_resid:
      operation: patching
      method: exact
      sites: {activation: resid_pre, over: [layer, position]}
      metric: logit_diff
      data: {task: ioi, n: 64}

An entry may say where it runs: `executor: {type: ray, workers: 4}` (docs/scale.md); the default is
in-process. `${VAR}` (or `${VAR:-default}`) is replaced from the environment; an unset variable, an unknown or
missing key and a wrong type are refused with the path of the key (`ioi_resid.sites.over[1]`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .config_model import config_error
from .data.loading import DataSpec
from .errors import ConfigError
from .registry import lookup, names

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def substitute_env(value: Any, where: str) -> Any:
    """Replace ${VAR} / ${VAR:-default} in every string of a nested structure."""
    if isinstance(value, dict):
        return {k: substitute_env(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_env(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        def repl(m: re.Match[str]) -> str:
            var, default = m.group(1), m.group(2)
            if var in os.environ:
                return os.environ[var]
            if default is not None:
                return default
            raise ConfigError(f"{where}: environment variable {var} is not set", code="env_unset",
                              remedy=f"export {var}=..., or write ${{{var}:-default}}")
        out = _ENV.sub(repl, value)
        if out != value:
            return yaml.safe_load(out) if out.strip() else out  # "${N}" -> 64, not "64"
        return out
    return value


def load_experiments(path: str | Path) -> dict[str, dict[str, Any]]:
    """The named entries of a YAML experiment file (env variables substituted)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"no experiment file at {p}", code="config_file_missing", remedy="check the path")
    if not p.is_file():
        raise ConfigError(f"{p} is not a file", code="config_file_missing", remedy="give the experiment file's path")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {' '.join(str(err).split())}", code="config_not_yaml",
                          remedy="fix the syntax (a truncated file: copy it again)") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"{p} cannot be read as YAML text ({type(err).__name__}: {err})", code="config_not_yaml",
                          remedy="give a YAML text file (UTF-8)") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{p} must map entry names to configs", code="config_shape",
                          remedy="write `name: {operation: ..., ...}` entries at the top level")
    return {name: substitute_env(entry, name) for name, entry in raw.items()}


def build_operation(entry: dict[str, Any], where: str = "config") -> tuple[Any, Any]:
    """(operation object, data spec or None) from one entry's dict."""
    entry = dict(entry)
    if "operation" not in entry:
        raise ConfigError(f"{where}.operation: missing key", code="config_invalid",
                          remedy=f"name the operation: one of {', '.join(names('operation'))}")
    op_name = entry.pop("operation")
    data = entry.pop("data", None)
    entry.pop("executor", None)  # where it runs is not part of the operation: executor_of(entry)
    try:
        cls = lookup("operation", op_name)
    except KeyError as err:
        raise ConfigError(f"{where}.operation: {err}", code="unknown_operation",
                          remedy=f"use one of {', '.join(names('operation'))}") from None
    try:
        op = cls.model_validate(entry)
    except ValidationError as err:
        raise config_error(err, where) from None
    spec = None
    if data is not None:
        if isinstance(data, (str, list)):
            data = {"prompts": [data] if isinstance(data, str) else data}
        try:
            spec = DataSpec.model_validate(data)
        except ValidationError as err:
            raise config_error(err, f"{where}.data") from None
    return op, spec


def executor_of(entry: dict[str, Any], where: str = "config", overrides: dict[str, Any] | None = None) -> Any:
    """The entry's `executor:` ({type: ray, workers: 4}; default in-process), with command-line overrides."""
    from .executors.config import NAMES

    value = entry.get("executor") or {}
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}.executor: expected a mapping such as {{type: ray, workers: 4}}, got {value!r}",
                          code="config_invalid", remedy="write executor: {type: ray, workers: 4}")
    overrides = overrides or {}
    if "type" in overrides and overrides["type"] != value.get("type", "in_process"):
        value = {}  # --executor in_process over an entry's Ray settings: none of them apply
    value = {**value, **overrides}
    kind = value.get("type", "in_process")
    if kind not in NAMES:
        raise ConfigError(f"{where}.executor.type: unknown executor {kind!r}", code="unknown_executor",
                          remedy="use type: in_process or type: ray")
    try:
        return NAMES[kind].model_validate(value)
    except ValidationError as err:
        raise config_error(err, f"{where}.executor") from None
