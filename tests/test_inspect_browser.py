"""The inspect page read in a real headless Chromium (Playwright driving the system's Chromium), on the demo
model and on the real SmolLM2-135M (30 layers x 9 heads: 270 small multiples) and Gemma 3 270M (sliding-window
layers): the checks every page gets (tests/test_pages_browser.py: no console error, every figure drawn, no
network, no control character, no wider than the window), then the attention view itself: one square per head,
the sliding-window layers marked, a click enlarging the head clicked, a hover reading a cell's weight, which
is the page's own number for that cell."""

from __future__ import annotations

import pytest

from entoscope.versions import installed_version

tl = installed_version("transformer-lens") or "0"
if int(tl.split(".")[0]) < 4:  # the pages are the same HTML in both passes; CI's browser reads them in the 4.x pass
    pytest.skip("the browser reads pages in the transformer-lens 4 pass (.ci/run)", allow_module_level=True)

from test_pages_browser import ARGS, CHROMIUM, WIDTH, _check_pages, playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.needs("browser")]  # a skip naming the extra; a failure where CI requires it

PROMPTS = {  # prompt, answer, wrong, counterfactual
    "demo": ("When Mary and John went to the store, John gave a drink to", " Mary", " John",
             "When Mary and John went to the store, Mary gave a drink to"),
    "smollm2": ("The Eiffel Tower is in Paris, and the Louvre is also located in the city of", " Paris", " Moscow",
                None),
    "gemma3": ("The Eiffel Tower is in Paris, and the Louvre is also located in the city of", " Paris", " Moscow",
               None),
}


@pytest.fixture(scope="module", params=["demo", pytest.param("smollm2", marks=pytest.mark.real),
                                        pytest.param("gemma3", marks=pytest.mark.real)])
def inspected(request, tmp_path_factory):
    """(model name, the Result, its saved folder)."""
    import entoscope as es

    if request.param == "demo":
        model = es.load_model("demo")
    else:
        from conftest import REAL_MODELS, real_model_folder

        model = es.load_model(str(real_model_folder(REAL_MODELS[request.param])))
    prompt, answer, wrong, cf = PROMPTS[request.param]
    result = es.inspect(model, prompt, answer=answer, wrong=wrong, counterfactual=cf)
    folder = result.save(tmp_path_factory.mktemp("inspect") / request.param)
    return request.param, result, folder


def test_the_inspect_page_renders_offline_and_reads_cleanly(inspected):
    name, _, folder = inspected
    _check_pages(folder.parent, [folder / "index.html"], f"inspect-{name}")


def test_the_attention_view_draws_every_head_and_answers_the_mouse(inspected):
    name, result, folder = inspected
    s = result.extra["structure"]
    L, H = s["n_layers"], s["n_heads"]
    _, layers = result.extra["window"]
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto((folder / "index.html").as_uri())
        page.wait_for_load_state("load")
        squares = page.locator(".esi-heads canvas")
        assert squares.count() == L * H
        marked = page.evaluate("() => document.querySelectorAll('.esi-heads .esi-local').length")
        assert marked == len(layers)
        squares.nth(L * H - 1).click()
        title = page.evaluate("() => document.querySelector('.esi-detail-title').textContent")
        assert title.startswith(f"a{L - 1}.h{H - 1}: layer {L - 1}, head {H - 1}")
        matrix = page.locator("canvas.esi-matrix")
        box = matrix.bounding_box()
        T, c = len(result.tokens), _cell(len(result.tokens))
        # the cells end 4 px before the canvas's right and bottom edges: hover the last query's first key
        page.mouse.move(box["x"] + box["width"] - 4 - (T - 0.5) * c, box["y"] + box["height"] - 4 - 0.5 * c)
        readout = page.evaluate("() => document.querySelector('.esi-readout').textContent")
        browser.close()
    assert not errors, errors
    weight = result.attention.query(f"layer == {L - 1} and head == {H - 1} and query_pos == {T - 1} and key_pos == 0")
    assert readout.startswith(f"a{L - 1}.h{H - 1}  query {T - 1} ") and "key 0 " in readout, readout
    assert readout.endswith(f"{float(weight['weight'].iloc[0]):.4f}"), readout


def _cell(T: int) -> int:
    """The enlarged view's cell size in pixels (assets/inspect.js: geometry)."""
    return max(6, min(24, 560 // T))
