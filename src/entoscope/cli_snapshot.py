"""The command line's options, written down, so that `entoscope --help`, `entoscope --version` and every
sub-command's `--help` start in a fraction of a second: building the parser itself imports every operation
(its flags come from the operations' pydantic fields) and so torch and transformer-lens.

`cli_snapshot.json` holds what `cli.build_parser()` builds (every sub-command, group and option, in order);
`parser_from_snapshot()` rebuilds the same argparse parser from it without importing anything heavy. The CLI
uses it to print help or the version and to refuse a usage mistake at once; a command line it accepts is parsed
again by the real parser, which the command runs with. A test keeps the
file equal to the real parser (`tests/test_startup.py`); after changing an operation's fields or a command's
options, write it again (a maintainer's script, which imports the real parser):

    python scripts/write_cli_snapshot.py
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("cli_snapshot.json")
_TYPES = {"int": int, "float": float, "str": str}
# what each kind of action accepts besides its option strings (argparse refuses the others)
_KWARGS = {"store": ("dest", "nargs", "const", "default", "type", "choices", "required", "help", "metavar"),
           "append": ("dest", "nargs", "const", "default", "type", "choices", "required", "help", "metavar"),
           "store_true": ("dest", "default", "required", "help"),
           "store_false": ("dest", "default", "required", "help"),
           "store_const": ("dest", "const", "default", "required", "help"),
           "count": ("dest", "default", "required", "help"),
           "version": ("dest", "help")}


def snapshot(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Everything `parser` (and its sub-parsers) holds that its help, usage and parsing depend on."""
    kinds = {cls: name for name, cls in parser._registries["action"].items() if name is not None}
    groups = parser._action_groups
    actions = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        group = next(i for i, g in enumerate(groups) if action in g._group_actions)
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            actions.append({"kind": "subparsers", "group": group, "dest": action.dest, "required": action.required,
                            "metavar": action.metavar, "help": action.help,
                            "choices": [{"name": name, "help": helps.get(name), "parser": snapshot(sub)}
                                        for name, sub in action.choices.items()]})
            continue
        kind = kinds[type(action)]
        entry: dict[str, Any] = {"kind": kind, "group": group, "option_strings": list(action.option_strings)}
        for key in _KWARGS[kind]:
            value = getattr(action, key)
            if key == "type" and value is not None:
                value = next(name for name, t in _TYPES.items() if t is value)
            entry[key] = list(value) if key == "choices" and value is not None else value
        actions.append(entry)
    return {"description": parser.description, "epilog": parser.epilog,
            "formatter_class": parser.formatter_class.__name__,
            "groups": [{"title": g.title, "description": g.description} for g in groups],
            "defaults": {k: _callable_name(v) if callable(v) else v for k, v in parser._defaults.items()},
            "actions": actions}


def parser_from_snapshot(snap: dict[str, Any], *, prog: str, version: str | None = None,
                         parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                         ) -> argparse.ArgumentParser:
    """The parser `snap` describes (`version`: the text of a --version option)."""
    p = parser_class(prog=prog, description=snap["description"], epilog=snap["epilog"],
                     formatter_class=getattr(argparse, snap["formatter_class"]))
    _fill(p, snap, version)
    return p


def _fill(p: argparse.ArgumentParser, snap: dict[str, Any], version: str | None) -> None:
    groups: list[Any] = [p._positionals, p._optionals]
    groups += [p.add_argument_group(g["title"], g["description"]) for g in snap["groups"][2:]]
    for entry in snap["actions"]:
        group = groups[entry["group"]]
        if entry["kind"] == "subparsers":
            sub = p.add_subparsers(dest=entry["dest"], required=entry["required"], metavar=entry["metavar"],
                                   help=entry["help"])
            for choice in entry["choices"]:
                child = choice["parser"]
                q = sub.add_parser(choice["name"], help=choice["help"], description=child["description"],
                                   epilog=child["epilog"], formatter_class=getattr(argparse, child["formatter_class"]))
                _fill(q, child, version)
            continue
        kwargs = {k: entry[k] for k in _KWARGS[entry["kind"]]}
        if kwargs.get("type") is not None:
            kwargs["type"] = _TYPES[kwargs["type"]]
        if entry["kind"] == "version":
            kwargs["version"] = version
        names = entry["option_strings"]
        if not names:  # a positional: its dest is its name
            names = [kwargs.pop("dest")]
            kwargs.pop("required", None)
        group.add_argument(*names, action=entry["kind"], **kwargs)
    p.set_defaults(**{k: _resolve(v) for k, v in snap["defaults"].items()})


def _callable_name(fn: Any) -> dict[str, str]:
    return {"callable": f"{fn.__module__}:{fn.__qualname__}"}


def _resolve(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"callable"}:
        module, _, name = value["callable"].partition(":")
        return getattr(importlib.import_module(module), name)
    return value


def load() -> dict[str, Any]:
    return json.loads(PATH.read_text(encoding="utf-8"))
