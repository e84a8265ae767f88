"""`ConfigModel`: the base of every config object (operations, sites, metrics, data specs, ...).

It forbids unknown keys and two silent misreadings pydantic would otherwise accept:
- a boolean where a number belongs. YAML reads `on`, `yes`, `true` as booleans, and pydantic would
  turn `layers: on` into layer 1; a field whose type has no `bool` refuses any boolean in its value.
- NaN or infinity in a float (a NaN threshold selects nothing, silently).

Every field carries a one-line meaning (`Field(description=...)`): `help(es.Patching)` lists the fields with
it (appended to the class's docstring, `fields_doc`), `entoscope patch --help` prints it beside each flag,
and scripts/write_reference.py writes it into docs/reference.md (with `type_text` and `allowed_text`).
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
                       remedy="fix the keys above (docs/reference.md lists every key with its type and values)")


FIELDS_HEADING = "Fields (YAML keys, --flags on the command line; docs/reference.md):"
_OWN_DOCS: dict[type, str] = {}  # each config class's docstring as written, before fields_doc is appended


def type_text(annotation: Any) -> str:
    """A field's type as Python spells it: `int | None`, `list[float]`, `Literal['a', 'b']`, `Sites`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def literal_values(annotation: Any) -> list[Any]:
    """The values a Literal annotation (alone or in a union, e.g. `Literal['a', 'b'] | None`) allows."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [v for a in args for v in literal_values(a)]
    return []


def allowed_text(info: Any) -> str:
    """What a field allows beyond its type: its Literal values, then its bounds (`>= 1, <= 4096`)."""
    parts = [", ".join("null" if v is None else str(v) for v in literal_values(info.annotation))]
    for bound in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(bound, attr, None) is not None:
                parts.append(f"{sign} {getattr(bound, attr)}")
    return ", ".join(p for p in parts if p)


def default_of(info: Any) -> Any:
    """A field's default as a value (a config's as the dict of what it sets, as `--help` shows it); `...` when
    the field is required."""
    if info.is_required():
        return ...
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_defaults=True) or value.model_dump()
    return value


def fields_doc(cls: type[BaseModel]) -> str:
    """The docstring section listing every field: `name: type = default`, then its meaning."""
    lines = ["", "", "    " + FIELDS_HEADING]
    for name, info in cls.model_fields.items():
        default = default_of(info)
        lines.append(f"        {name}: {type_text(info.annotation)}" + ("" if default is ... else f" = {default!r}"))
        line = ""
        for word in (info.description or "").split():  # wrapped at 100 columns (textwrap costs ms at import)
            if line and len(line) + len(word) >= 88:
                lines.append(" " * 12 + line)
                line = ""
            line = f"{line} {word}" if line else word
        if line:
            lines.append(" " * 12 + line)
    return "\n".join(lines)


def own_doc(cls: type) -> str:
    """A config class's docstring as written (help() shows it with fields_doc appended)."""
    return _OWN_DOCS.get(cls, cls.__doc__ or "")


class ConfigModel(BaseModel):
    """A validated, serialisable config: unknown keys, booleans-as-numbers and NaN/inf are refused.

    Built from Python, a refused value raises ConfigError (code config_invalid) like YAML and the CLI.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """help() of a config class lists its fields with their meanings (fields_doc)."""
        super().__pydantic_init_subclass__(**kwargs)
        _OWN_DOCS[cls] = cls.__dict__.get("__doc__") or ""
        cls.__doc__ = _OWN_DOCS[cls].rstrip() + fields_doc(cls)

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
