"""Every relative link in README.md and docs/*.md points to a file that exists, and to a heading of that file where
it names an anchor (GitHub's anchors: the heading's text, lower-case, punctuation dropped, spaces to '-', a repeated
heading's anchor suffixed -1, -2, ...). The slug rule is written here again, apart from scripts/write_reference.py,
and checked against anchors GitHub gives."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def github_anchor(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]*>", "", text)                       # HTML tags
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            base = github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out |= set(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", line))
    return out


def links_of(path: Path) -> list[str]:
    """Link targets of a markdown file, outside code blocks and code spans: [text](target), ![alt](target),
    <img src>, <a href>."""
    text, out = path.read_text(encoding="utf-8"), []
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"(`+)(?:(?!\1).)+\1", "", text, flags=re.S)
    out += re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    out += re.findall(r"""<(?:img|a)\s[^>]*?(?:src|href)=["']([^"']+)["']""", text)
    return out


def test_the_anchor_rule_is_githubs():
    assert github_anchor("Every benchmark's figures") == "every-benchmarks-figures"
    assert github_anchor("Logit lens — `es.Lens(method=\"logit\")`") == "logit-lens--eslensmethodlogit"
    assert github_anchor("Executors: Ray and resume (docs/scale.md)") == "executors-ray-and-resume-docsscalemd"
    assert github_anchor("The model spec: workers load their own replica") == \
        "the-model-spec-workers-load-their-own-replica"
    assert github_anchor("A, B & C_d") == "a-b--c_d"


def test_the_link_reader_skips_code():
    page = ROOT / "docs" / "x.md"
    text = "see [a](a.md#b) and `[c](c.md)`\n```\n[d](d.md)\n```\n<img src=\"i.png\" alt=\"x\">"
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        page = Path(d) / "x.md"
        page.write_text(text, encoding="utf-8")
        assert links_of(page) == ["a.md#b", "i.png"]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_relative_link_resolves(path):
    broken = []
    for target in links_of(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            broken.append(f"{target}: no file {where}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors_of(dest):
            broken.append(f"{target}: {where} has no heading whose anchor is #{anchor}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)
