"""docs/reference.md is written from the code (scripts/write_reference.py) and is current; it holds every field
of every operation and of the configs they take, every command-line option and every error code, each with its
meaning; the meaning of a field is the same in Python's help(), in `--help` and in the reference; no option's
`--help` is only its default."""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import write_reference as wr  # noqa: E402

REFERENCE = ROOT / "docs" / "reference.md"


def squeeze(text: str) -> str:
    """Text with every whitespace run removed (argparse and pydoc wrap lines, and may wrap at a hyphen)."""
    return re.sub(r"\s+", "", text)


def as_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(text: str) -> dict[str, str]:
    """### heading -> its text, read from the page."""
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def rows(section: str) -> dict[str, list[str]]:
    """First cell (the name in backticks) -> the row's cells."""
    out = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            out[cells[0].strip("`").strip()] = cells
    return out


def operations() -> list[type]:
    from entoscope.registry import lookup, names

    return [lookup("operation", n) for n in names("operation")]


def configs_of(classes: list[type]) -> list[type]:
    """Every pydantic config a field of `classes` takes, at any depth (walked here, apart from the script)."""
    found: list[type] = []
    todo = [info.annotation for cls in classes for info in cls.model_fields.values()]
    while todo:
        ann = todo.pop()
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if ann not in found and ann not in classes:
                found.append(ann)
                todo += [info.annotation for info in ann.model_fields.values()]
        else:
            todo += list(typing.get_args(ann))
    return found


def options(parser: argparse.ArgumentParser):
    """(command, action) of every option of the real parser and its sub-commands (help actions left out)."""
    sub = parser._subparsers._group_actions[0]
    for command, p in [("", parser)] + list(sub.choices.items()):
        for action in p._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                yield command, action


def meaning_of(action: argparse.Action) -> str:
    """An option's help without its default (`[default: ...]`)."""
    return re.sub(r"\[default: .*\]\s*$", "", action.help or "").replace("%%", "%").strip()


@pytest.fixture(scope="module")
def page() -> str:
    return REFERENCE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def parser():
    from entoscope.cli import build_parser

    return build_parser()


def test_the_reference_and_the_contents_lists_are_current():
    """Checked in a fresh interpreter: other tests in this worker may have registered names of their own (a
    custom metric, pooling or operation), which the reference of the package itself does not hold."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "write_reference.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-1500:]}{out.stderr[-1500:]} (write them again with " \
                                "`python scripts/write_reference.py`)"


def test_a_field_added_without_writing_the_reference_again_is_caught(capsys):
    from entoscope import registry
    from entoscope.lens.operation import Lens

    class LensWithAKnob(Lens):
        """A lens with one more field (made by this test)."""

        name = "lens_with_a_knob"
        knob: int = Field(default=3, ge=1, description="a field the reference does not hold yet")

    registry.register("operation", LensWithAKnob.name)(LensWithAKnob)
    try:
        text = wr.reference_text()
        assert wr.main(["--check"]) == 1 and "out of date: docs/reference.md" in capsys.readouterr().out
    finally:
        registry._REGISTRY["operation"].pop(LensWithAKnob.name)
    knob = rows(sections(text)["LensWithAKnob"])["knob"]
    assert knob[1:] == ["int", "`3`", ">= 1", "a field the reference does not hold yet"]


def test_every_field_of_every_operation_and_config_has_a_meaning():
    from entoscope.data.loading import DataSpec
    from entoscope.executors.config import InProcess, Ray

    ops = operations()
    missing = [f"{cls.__name__}.{name}" for cls in ops + configs_of(ops) + [DataSpec, InProcess, Ray]
               for name, info in cls.model_fields.items() if len((info.description or "").split()) < 2]
    assert not missing, f"fields without a one-line meaning (Field(description=...)): {missing}"


def test_no_options_help_is_only_its_default(parser):
    bare = [f"entoscope {command} {'/'.join(a.option_strings) or a.dest}".replace("  ", " ")
            for command, a in options(parser) if len(meaning_of(a).replace("(Ray)", "").split()) < 2]
    assert not bare, f"options whose --help says no meaning: {bare}"


def test_the_reference_holds_every_field_with_its_type_default_and_meaning(page):
    from entoscope.data.loading import DataSpec

    blocks = sections(page)
    ops = operations()
    for cls in ops + configs_of(ops) + [DataSpec]:
        table = rows(blocks[cls.__name__])
        assert set(table) == set(cls.model_fields), cls.__name__
        for name, info in cls.model_fields.items():
            row = table[name]
            assert row[-1] == as_cell(info.description), f"{cls.__name__}.{name}"
            if info.is_required():
                assert row[2] == "required"
            elif isinstance(info.default, (bool, int, float)) and not isinstance(info.default, bool):
                assert row[2] == f"`{info.default}`", f"{cls.__name__}.{name}"
            elif isinstance(info.default, bool):
                assert row[2] == f"`{str(info.default).lower()}`"
            for value in typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal \
                    else []:
                assert str(value) in row[3], f"{cls.__name__}.{name}: allowed value {value} missing"


def test_the_reference_holds_every_command_and_option_with_its_meaning(page, parser):
    blocks = sections(page)
    for command, action in options(parser):
        table = rows(blocks[f"entoscope {command}".strip()])
        name = ", ".join(action.option_strings) or action.dest
        assert name in table, f"entoscope {command}: {name} is not in the reference"
        assert table[name][-1].replace("\\|", "|") == " ".join(meaning_of(action).split()), \
            f"entoscope {command} {name}"


def test_python_help_the_command_line_and_the_reference_say_the_same(page, parser):
    from entoscope.cli import CLI_NAMES
    from entoscope.registry import lookup

    blocks = sections(page)
    sub = parser._subparsers._group_actions[0].choices
    for command, op in CLI_NAMES.items():
        cls = lookup("operation", op)
        python_help = squeeze(inspect.getdoc(cls) or "")
        command_help = squeeze(sub[command].format_help())
        table = rows(blocks[cls.__name__])
        for name, info in cls.model_fields.items():
            said = squeeze(info.description)
            assert said in python_help, f"help({cls.__name__}) does not say what {name} means"
            assert f"--{name.replace('_', '-')}" in sub[command].format_help() and said in command_help, \
                f"entoscope {command} --help: --{name}"
            assert squeeze(table[name][-1].replace("\\|", "|")) == said, f"reference: {cls.__name__}.{name}"


def test_every_code_is_in_the_reference_with_a_meaning(page):
    raised = set()
    for path in (ROOT / "src" / "entoscope").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        raised |= set(re.findall(r'\bcode\s*=\s*"([a-z0-9_]+)"', text))
        raised |= set(re.findall(r'\bcode:\s*str\s*=\s*"([a-z0-9_]+)"', text))
    codes_part = page[page.index("## Error and warning codes"):page.index("## Registered names")]
    table = rows(codes_part)
    assert raised <= set(table), f"codes not in the reference: {sorted(raised - set(table))}"
    for code in raised:
        meaning = table[code][2]
        assert len(meaning.split()) >= 2 and "not yet in docs/errors.md" not in meaning, code
