"""docs/ by question: every page opens with what it answers and a runnable example (run here, on the demo model,
in a fresh folder), a long page has a contents list of all its sections, and docs/README.md maps questions to the
pages (and sections) that answer them. The links themselves are checked in tests/test_docs_links.py."""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

from extras import require

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
LONG = 150  # lines: a longer page of two sections or more lists them at the top
# what an opening example needs beyond the README's install: (extra, pytest marker)
NEEDS = {"migration.md": ("nnsight", None), "real_models.md": ("real", "real")}
# the examples that take seconds (the others together take about ten, most of it importing torch): the slow set
SLOW = {"circuits.md", "features.md", "interchange.md", "patching.md", "real_models.md", "report.md", "steering.md"}


def opening(text: str) -> tuple[str, str]:
    """(the prose between the page's title and its first code block, the first Python block before the first ##
    heading: '' when there is none). A shell block may come before the Python one (install, then run)."""
    lines = text.splitlines()
    assert lines and lines[0].startswith("# "), "a page starts with its title"
    prose: list[str] = []
    fenced_before, i = False, 1
    while i < len(lines) and not lines[i].startswith("## "):
        if lines[i].startswith("```"):
            end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            if lines[i].strip() == "```python":
                return "\n".join(prose), "\n".join(lines[i + 1:end]) + "\n"
            fenced_before, i = True, end + 1
            continue
        if not fenced_before:
            prose.append(lines[i])
        i += 1
    return "\n".join(prose), ""


def sections(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            out.append(line[3:].strip())
    return out


def test_the_opening_reader_finds_prose_and_the_first_python_block():
    page = "# T\n\nThis page answers: x.\n\n```bash\nls\n```\n\n```python\nprint(1)\n```\n\n## A\n```python\n2\n```\n"
    assert opening(page) == ("\nThis page answers: x.\n", "print(1)\n")
    assert opening("# T\n\n## A\n\n```python\nprint(1)\n```\n")[1] == ""  # an example under a heading is not opening
    assert opening("# T\n\n```python\nx = 1\n```\nmore\n") == ("", "x = 1\n")  # no prose first


@pytest.mark.parametrize("name", PAGES)
def test_every_page_opens_with_what_it_answers_and_an_example(name):
    prose, code = opening((DOCS / name).read_text(encoding="utf-8"))
    assert len(" ".join(prose.split())) >= 40, f"docs/{name}: one or two lines saying what the page answers come first"
    assert code.strip(), f"docs/{name}: a runnable Python example comes before the first ## heading"


@pytest.mark.parametrize("name", PAGES)
def test_a_long_page_lists_all_its_sections_first(name):
    text = (DOCS / name).read_text(encoding="utf-8")
    if len(text.splitlines()) <= LONG or len(sections(text)) < 2:
        return
    contents = re.search(r"^\*\*Contents:\*\*(.*?)(?:\n\s*\n)", text, flags=re.S | re.M)
    assert contents, f"docs/{name} has {len(text.splitlines())} lines and no **Contents:** paragraph"
    assert text.index("**Contents:**") < text.index("\n## "), f"docs/{name}: the contents come before the sections"
    listed = [re.sub(r"\s+", " ", t) for t in re.findall(r"\[([^\]]+)\]\(#", contents.group(1))]
    wanted = [re.sub(r"[`*]", "", s) for s in sections(text)]
    assert listed == wanted, f"docs/{name}: write the contents again (python scripts/write_reference.py)"


def _run(code: str, name: str, folder: Path, monkeypatch) -> dict:
    monkeypatch.chdir(folder)  # examples save runs/...: into a fresh folder
    label = f"<docs/{name} opening example>"
    linecache.cache[label] = (len(code), None, code.splitlines(True), label)  # nnsight reads a trace's source
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code, label, "exec"), namespace)
    return namespace


def _example_params():
    params = []
    for name in PAGES:
        extra, marker = NEEDS.get(name, (None, None))
        marks = ([pytest.mark.slow] if name in SLOW else []) + ([getattr(pytest.mark, marker)] if marker else [])
        params.append(pytest.param(name, extra, marks=marks, id=name))
    return params


@pytest.mark.parametrize("name, extra", _example_params())
def test_each_pages_opening_example_runs(name, extra, tmp_path, monkeypatch):
    if extra == "real":
        from conftest import REAL_MODELS, real_model_folder

        real_model_folder(REAL_MODELS["smollm2"])  # fetched (or the test skips, naming how to fetch it)
    elif extra:
        require(extra)
    _, code = opening((DOCS / name).read_text(encoding="utf-8"))
    _run(code, name, tmp_path, monkeypatch)
