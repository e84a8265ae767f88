"""Every refusal code raised in the source is listed in docs/errors.md (callers branch on them)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def codes_in_source() -> set[str]:
    found = set()
    for path in (ROOT / "src" / "entoscope").rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'\bcode\s*=\s*"([a-z0-9_]+)"', text))
        found |= set(re.findall(r'\bcode:\s*str\s*=\s*"([a-z0-9_]+)"', text))
    return found


def test_every_code_is_documented():
    documented = set(re.findall(r"`([a-z0-9_]+)`", (ROOT / "docs" / "errors.md").read_text()))
    missing = sorted(codes_in_source() - documented)
    assert not missing, f"codes raised but not listed in docs/errors.md: {missing}"


def test_errors_subclass_the_builtin_they_resemble():
    from entoscope import errors

    assert issubclass(errors.SiteError, ValueError) and issubclass(errors.UnsupportedModelError, TypeError)
    assert issubclass(errors.UnknownNameError, KeyError) and issubclass(errors.DataError, ValueError)
    err = errors.DataError("x is wrong", remedy="do y", code="lengths_differ")
    assert err.code == "lengths_differ" and "do y" in str(err) and str(err).startswith("[lengths_differ]")
