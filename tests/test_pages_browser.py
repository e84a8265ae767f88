"""Every page the report writes, opened in a real headless Chromium (Playwright driving the system's
Chromium: nothing is downloaded). Each page must: log no console error, render every plotly figure,
request nothing outside its folder (no network), hold no control character in its text, and fit the
window's width. Full-page screenshots are saved for a reader to look at (ENTOSCOPE_ARTIFACTS, default
test-artifacts/pages/). Skipped, saying why, only where no Chromium or no Playwright is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extras import chromium, require

CHROMIUM = chromium()
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
WIDTH = 1280

pytestmark = pytest.mark.slow  # a browser reading every page: minutes (CI runs them: -m slow)
playwright = require("browser")  # Playwright and a Chromium, or one skip line (a failure where CI requires them)

RENDERED = "() => [...document.querySelectorAll('.plotly-graph-div')].every(f => f.querySelector('.main-svg'))"
CHECKS = """() => {
  const figures = [...document.querySelectorAll('.plotly-graph-div')];
  const empty = figures.filter(f => !f.querySelector('.main-svg')).map(f => f.id);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const control = [];
  while (walker.nextNode()) {
    const t = walker.currentNode.nodeValue;
    if (/[\\u0000-\\u0008\\u000b\\u000c\\u000e-\\u001f\\u007f]/.test(t)) control.push(t.slice(0, 40));
  }
  const limit = document.documentElement.clientWidth;
  const wide = [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > limit + 1)
    .map(e => e.tagName + '.' + e.className).slice(0, 5);
  return {figures: figures.length, empty, control, wide, scrollWidth: document.documentElement.scrollWidth, limit};
}"""


@pytest.fixture(scope="module", params=["demo", pytest.param("smollm2", marks=pytest.mark.real),
                                        pytest.param("gemma3", marks=pytest.mark.real)])
def report(request, tmp_path_factory):
    """The demo's quick report, and the real models' (conftest.real_report: 30 and 18 layers' figures)."""
    import entoscope as es
    from entoscope.report import build_report

    if request.param != "demo":
        from conftest import real_report

        return real_report(request.param, tmp_path_factory)
    folder = tmp_path_factory.mktemp("report") / "demo"
    build_report(es.load_model("demo"), folder, quick=True)
    return folder


def _pages(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.html"))


def _artifacts() -> Path:
    out = Path(os.environ.get("ENTOSCOPE_ARTIFACTS", "test-artifacts")) / "pages"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_every_report_page_renders_offline_and_reads_cleanly(report):
    pages = _pages(report)
    assert len(pages) >= (8 if report.name == "demo" else 4)
    _check_pages(report, pages, "report")


def test_every_example_page_renders_offline_and_reads_cleanly(example_runs):
    folders = list(example_runs.values())
    root = folders[0].parent.parent
    _check_pages(root, [p for f in folders for p in _pages(f)], "examples")


def _check_pages(root: Path, pages: list[Path], label: str) -> None:
    from playwright.sync_api import sync_playwright

    problems: dict[str, list[str]] = {}
    shots = _artifacts() / label
    shots.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        # one tab reads every page in turn: a fresh tab per page parses plotly.js again each time (about 2 s a
        # page here, against 0.7 s); what a page logs or requests is collected from its own navigation on
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        errors: list[str] = []
        outside: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: outside.append(r.url)
                if not r.url.startswith(("file://", "data:", "blob:", "about:")) else None)
        for path in pages:
            errors.clear()
            outside.clear()
            page.goto(path.as_uri())
            page.wait_for_load_state("load")
            try:  # every figure drawn (a figure that never draws is reported below as not rendered)
                page.wait_for_function(RENDERED, timeout=5000)
            except playwright.TimeoutError:
                pass
            found = page.evaluate(CHECKS)
            name = path.relative_to(root).as_posix()
            page.screenshot(path=str(shots / (name.replace("/", "__") + ".png")), full_page=True)
            issues = [f"console: {e}" for e in errors] + [f"network: {u}" for u in outside]
            issues += [f"figure not rendered: {f}" for f in found["empty"]]
            issues += [f"control character in text: {t!r}" for t in found["control"]]
            if found["scrollWidth"] > found["limit"] + 1:
                issues.append(f"wider than the window ({found['scrollWidth']} > {found['limit']}): {found['wide']}")
            if issues:
                problems[name] = issues
        browser.close()
    assert not problems, "\n".join(f"{k}: {v}" for k, v in problems.items())
