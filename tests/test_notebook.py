"""The walkthrough notebook runs from top to bottom (nbclient), and every Result it shows displays itself inline:
its takeaway, figure and table, and the inspect view (the token grids, the attention view's script and data),
offline: plotly.js travels in the notebook once, nothing is fetched. The outputs are then read in a real
headless Chromium, in order, as one page as a notebook shows them: no console error, every figure drawn, the
attention view drawn and answering a click."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a kernel executing the notebook: tens of seconds (CI runs it: -m slow)

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "walkthrough.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook executed offline; its HTML outputs in order."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    folder = tmp_path_factory.mktemp("notebook")
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
                            ).execute()
    return nb


def _html_outputs(nb) -> list[str]:
    return [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "text/html" in o.get("data", {})]


def test_walkthrough_notebook_executes_and_results_display_themselves(executed):
    html_outputs = _html_outputs(executed)
    shown = [h for h in html_outputs if "plotly-graph-div" in h]
    assert len(shown) >= 4  # the inspect view, the lens, the patching and the circuit Results
    assert all("<table" in h for h in shown)
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_the_inspect_view_is_inline_and_offline(executed):
    html_outputs = _html_outputs(executed)
    views = [h for h in html_outputs if 'class="esi-root"' in h]
    assert len(views) == 1
    view = views[0]
    for part in ("logit lens", "attention patterns", "direct logit attribution", "activation patching",
                 "window.entoscopeInspect(", 'type="application/json"'):
        assert part in view, part
    everything = "".join(html_outputs)
    assert everything.count("* plotly.js v") == 1  # the bundle once, in the first output that draws a figure
    assert everything.index("* plotly.js v") < everything.index("Plotly.newPlot")
    assert not re.search(r"<script[^>]+src=", everything), "an output loads a script from elsewhere"


@pytest.mark.needs("browser")  # a skip naming the extra; a failure where CI requires it (tests/extras.py)
def test_the_outputs_render_in_a_browser(executed, tmp_path):
    """Every HTML output, in order, on one page (as the notebook shows them) read by headless Chromium."""
    playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
    from test_pages_browser import ARGS, RENDERED

    page_file = tmp_path / "outputs.html"
    page_file.write_text("<!doctype html><html><head><meta charset='utf-8'></head><body>"
                         + "\n".join(f"<div class='output'>{h}</div>" for h in _html_outputs(executed))
                         + "</body></html>", encoding="utf-8")
    errors: list[str] = []
    outside: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: outside.append(r.url)
                if not r.url.startswith(("file://", "data:", "blob:", "about:")) else None)
        page.goto(page_file.as_uri())
        page.wait_for_load_state("load")
        page.wait_for_function(RENDERED, timeout=20000)
        heads = page.evaluate("() => document.querySelectorAll('.esi-heads canvas').length")
        page.locator(".esi-heads canvas").last.click()
        after = page.evaluate("() => document.querySelector('.esi-detail-title').textContent")
        browser.close()
    assert not errors, errors
    assert not outside, outside
    assert heads == 3 * 4  # the demo model: 3 layers x 4 heads
    assert after.startswith("a2.h3: layer 2, head 3")  # the last head, enlarged on a click
