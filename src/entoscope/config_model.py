"""`ConfigModel`: the base of every config object (operations, sites, metrics, data specs, ...).

It forbids unknown keys and two silent misreadings pydantic would otherwise accept:
- a boolean where a number belongs. YAML reads `on`, `yes`, `true` as booleans, and pydantic would
  turn `layers: on` into layer 1; a field whose type has no `bool` refuses any boolean in its value.
- NaN or infinity in a float (a NaN threshold selects nothing, silently).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from .errors import ConfigError


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any or annotation is object:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _admits_bool(typing.get_args(annotation)[0])
    return False


def _has_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_bool(v) for v in value)
    if isinstance(value, dict):
        return any(_has_bool(v) for v in value.values())
    return False


def _element_admits_bool(annotation: Any) -> bool:
    """Whether a container annotation (list[...], dict[str, ...]) may hold booleans somewhere."""
    if _admits_bool(annotation):
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_element_admits_bool(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True  # a nested config validates its own fields
    return any(_element_admits_bool(a) for a in args)


def config_error(err: ValidationError, where: str) -> ConfigError:
    """A pydantic validation error as one ConfigError naming each key's path (`entry.sites.over[1]`)."""
    lines = []
    for e in err.errors():
        loc = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):  # raised by a nested ConfigModel's __init__: re-root its key paths
            lines += [re.sub(r"^[A-Za-z_]\w*", lambda m: loc, part) for part in inner.message.split("; ")]
            continue
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        elif e["type"] == "missing":
            lines.append(f"{loc}: missing key")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg} (got {e.get('input')!r})")
    return ConfigError("; ".join(lines), code="config_invalid",
                       remedy="fix the keys above (docs/operations.md lists every key)")


class ConfigModel(BaseModel):
    """A validated, serialisable config: unknown keys, booleans-as-numbers and NaN/inf are refused.

    Built from Python, a refused value raises ConfigError (code config_invalid) like YAML and the CLI.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise config_error(err, type(self).__name__) from None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None or not _has_bool(value):
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool):
            if _admits_bool(annotation):
                return value
        elif _element_admits_bool(annotation):
            return value
        raise ValueError("a boolean where a number or name belongs (YAML reads on, off, yes, no, true and false "
                         "as booleans): write the number or name itself")
