"""The shared guard for optional extras (tests/extras.py): a missing extra skips with one line naming it, the
same absence fails where CI sets ENTOSCOPE_REQUIRE_<EXTRA>=1, and a test that reaches a missing extra through
entoscope's own refusal is caught by the same guard. Also: the README's two commands are the text .ci/run runs
first, so CI cannot drift from what a new user types."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import extras
from entoscope.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ABSENT = extras.Extra("entoscope_no_such_module_xyz", "ENTOSCOPE_REQUIRE_ABSENT_XYZ", "pip install nothing")


@pytest.fixture
def absent(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "absent", ABSENT)
    monkeypatch.delenv(ABSENT.env, raising=False)
    return monkeypatch


def test_a_missing_extra_skips_with_one_line_naming_it(absent):
    with pytest.raises(pytest.skip.Exception) as skipped:
        extras.require("absent")
    line = str(skipped.value)
    assert "\n" not in line and "absent extra" in line and "pip install nothing" in line


def test_the_same_absence_fails_where_ci_requires_the_extra(absent):
    absent.setenv(ABSENT.env, "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        extras.require("absent")
    assert ABSENT.env in str(failed.value)


def test_a_present_extra_returns_its_module(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "json", extras.Extra("json", "ENTOSCOPE_REQUIRE_JSON_XYZ", ""))
    import json

    assert extras.require("json") is json and extras.missing("json") == ""


def test_entoscopes_refusal_of_a_missing_extra_is_traced_to_it(absent, monkeypatch):
    monkeypatch.setitem(extras.MISSING_CODES, "absent_missing", "absent")
    try:
        try:
            raise ConfigError("the absent backend needs the absent package", code="absent_missing", remedy="install")
        except ConfigError as inner:
            raise RuntimeError("while loading") from inner
    except RuntimeError as err:
        assert extras.extra_behind(err) == "absent"
    try:
        import entoscope_no_such_module_xyz  # noqa: F401
    except ModuleNotFoundError as err:
        assert extras.extra_behind(err) == "absent"
    # a refusal of an extra that IS installed is a real failure, not a skip
    assert extras.extra_behind(ConfigError("x", code="nnsight_missing", remedy="y")) == (
        "nnsight" if extras.missing("nnsight") else "")
    assert extras.extra_behind(ValueError("unrelated")) == ""


def _bash_blocks_after(text: str, heading: str) -> str:
    """The first ```bash block after the line holding `heading`, as one line."""
    rest = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", rest, flags=re.S)
    assert block is not None, heading
    lines = [line for line in block.group(1).strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"the README's {heading!r} block holds one command: {lines}"
    return lines[0]


def test_ci_runs_the_readmes_two_commands_exactly_as_written():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    main_job = _bash_blocks_after(readme, "Install and run the main job")
    tests = _bash_blocks_after(readme, "Install and run the tests")
    assert "entoscope report --model demo" in main_job and "pytest" in tests
    said = dict(re.findall(r"^(README_MAIN_JOB|README_TESTS)='(.*)'$", ci, flags=re.M))
    assert said == {"README_MAIN_JOB": main_job, "README_TESTS": tests}
    # they run first, before anything else installs or exports: a fresh clone, a fresh venv each
    first_run = ci.index('run_readme_command "$README_MAIN_JOB"')
    assert first_run < ci.index("apt-get") and first_run < ci.index("run_suite .venv")
    assert ci.index('run_readme_command "$README_TESTS"') < ci.index("run_suite .venv")
