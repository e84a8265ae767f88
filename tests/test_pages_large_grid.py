"""Pages of a model the size of a small real one (30 layers, 9 heads, prompts of 15 tokens), read in a real
headless Chromium: a 30 x 15 layer-by-position map and a 270-head map must stay legible. On a random-weight
Llama of that shape (SmolLM2-135M's layers and heads, a narrow width), so no real model is needed.

Checked on each figure as the browser draws it: no two tick labels of an axis overlap; a heatmap writes
text in its cells only where the drawn cells are large enough (each text inside its cell's width and
height); hovering a cell shows that cell's value as the table has it (its site and `value`), found from
the figure's own axes. Skipped, saying why, where no Chromium or
no Playwright is installed (like tests/test_pages_browser.py)."""

from __future__ import annotations


import pytest

from extras import chromium, require

CHROMIUM = chromium()
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
pytestmark = pytest.mark.slow
playwright = require("browser")  # Playwright and a Chromium, or one skip line (a failure where CI requires them)

N_LAYERS, N_HEADS, T = 30, 9, 15

OVERLAPS = """() => {
  const found = [];
  document.querySelectorAll('.plotly-graph-div').forEach((gd, f) => {
    const groups = {};
    gd.querySelectorAll('g[class$="tick"] > text').forEach(t => {
      const r = t.getBoundingClientRect();
      if (r.width > 0 && t.textContent) (groups[t.parentNode.getAttribute('class')] ||= []).push([t.textContent, r]);
    });
    for (const [axis, boxes] of Object.entries(groups))
      for (let i = 0; i < boxes.length; i++)
        for (let j = i + 1; j < boxes.length; j++) {
          const [a, ra] = boxes[i], [b, rb] = boxes[j];
          const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
          const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
          if (w > 1 && h > 1) found.push(`figure ${f} ${axis}: '${a}' and '${b}'`);
        }
  });
  return found.slice(0, 10);
}"""
CELLS = """() => [...document.querySelectorAll('.plotly-graph-div')].map(gd => gd._fullData.map((t, i) => {
  if (t.type !== 'heatmap') return null;
  const xa = gd._fullLayout[t.xaxis.replace('x', 'xaxis')], ya = gd._fullLayout[t.yaxis.replace('y', 'yaxis')];
  const texts = [...gd.querySelectorAll('.heatmaplayer text')].filter(e => e.textContent)
    .map(e => e.getBoundingClientRect()).map(r => [r.left, r.right, r.top, r.bottom]);
  return {cells: t.z.length * t.z[0].length, x: t.x, y: t.y, wide: xa._length / t.z[0].length, tall: ya._length / t.z.length,
          template: t.texttemplate || null, texts};
}))"""
CENTRE = """([f, row, col]) => {  // the cell's centre on the page, from the figure's own axes
  const gd = document.querySelectorAll('.plotly-graph-div')[f], t = gd._fullData[0];
  gd.scrollIntoView({block: 'start'});
  const box = gd.getBoundingClientRect();
  const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
  return [box.left + xa._offset + xa.d2p(t.x[col]), box.top + ya._offset + ya.d2p(t.y[row])];
}"""


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch
    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=N_LAYERS, hidden_size=36, num_attention_heads=N_HEADS, num_key_value_heads=3,
                      intermediate_size=72, max_position_embeddings=64, vocab_size=len(tiny_tokenizer()),
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.config._attn_implementation = "eager"
    return from_hf(hf, tiny_tokenizer(), backend="bridge", name="random-llama-30x9", folder=tokenizer_dir())


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    import torch

    import entoscope as es
    from entoscope.data import Dataset, Example

    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 300, (4, T), generator=g)
    ids[:, 0] = 0
    data = Dataset("grid", tuple(Example(tuple(ids[i].tolist()), tuple(ids[i + 2].tolist()), answers=(11,),
                                         wrong_answers=(17,)) for i in range(2)))
    root = tmp_path_factory.mktemp("large-grid")
    results = {}
    for name, sites in (("heads", es.Sites(activation="z", over=["layer", "head"])),
                        ("resid", es.Sites(activation="resid_pre", over=["layer", "position"]))):
        result = es.Patching(sites=sites, comparison="absolute").run(model, data, quiet=True)
        result.save(root / name)
        results[name] = result
    return root, results


@pytest.mark.parametrize("name", ["heads", "resid"])
def test_large_grid_page_is_legible(pages, name):
    from playwright.sync_api import sync_playwright

    from entoscope.results.figures import CELL_TEXT_PX, CELL_TEXT_ROW_PX, MAX_CELL_TEXT

    root, results = pages
    table = results[name].table
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1600})  # a 30-row figure in view
        page.goto((root / name / "index.html").as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.plotly-graph-div')]"
                               ".every(f => f.querySelector('.main-svg'))", timeout=20000)
        overlaps = page.evaluate(OVERLAPS)
        figures = page.evaluate(CELLS)
        grid = next(t for fig in figures for t in fig if t and t["cells"] == len(table))  # the site map
        f = next(i for i, fig in enumerate(figures) if any(t and t["cells"] == len(table) for t in fig))
        site = table.iloc[len(table) // 2 + 3]  # a cell inside the grid, not on its edge
        col_name = "head" if name == "heads" else "position"
        row = [int(v) for v in grid["y"]].index(int(site["layer"]))
        col = next(i for i, x in enumerate(grid["x"]) if str(x).lstrip("h").split(":")[0] == str(int(site[col_name])))
        page.mouse.move(*page.evaluate(CENTRE, [f, row, col]))
        page.wait_for_function("() => document.querySelector('.hoverlayer')?.textContent", timeout=5000)
        hover = page.evaluate("() => document.querySelector('.hoverlayer').textContent")
        browser.close()
    assert not overlaps, overlaps
    heatmaps = [t for fig in figures for t in fig if t]
    for t in heatmaps:  # text in cells only where a cell holds it: each text inside its column, none overlapping
        if t["texts"]:
            assert t["wide"] >= CELL_TEXT_PX and t["tall"] >= CELL_TEXT_ROW_PX and t["cells"] <= MAX_CELL_TEXT, t
            assert max(r[1] - r[0] for r in t["texts"]) <= t["wide"] and max(r[3] - r[2] for r in t["texts"]) <= t["tall"]
    assert grid["template"] is not None and len(grid["texts"]) == len(table)  # 270 / 450 cells: large enough
    assert site["site"] in hover and f"value {float(site['value']):.3g}" in hover, hover


def test_cell_text_leaves_cells_too_small_to_read():
    """The rule behind the browser check, on figures whose cells the page would draw too small: 270 rows
    (16 px each), 30 columns of three panels; a 30 x 9 grid keeps its numbers."""
    import numpy as np
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from entoscope.results.figures import polish

    z = np.random.default_rng(0).normal(size=(270, 15))
    tall = polish(go.Figure(go.Heatmap(z=z, texttemplate="%{z:.2f}")))
    assert tall.data[0].texttemplate is None and tall.layout.height >= 270 * 16
    panels = make_subplots(rows=1, cols=3)
    for c in (1, 2, 3):
        panels.add_trace(go.Heatmap(z=z[:30, :10], texttemplate="%{z:.2f}"), row=1, col=c)
    assert all(t.texttemplate is None for t in polish(panels).data)
    kept = polish(go.Figure(go.Heatmap(z=z[:30, :9], texttemplate="%{z:.2f}")))
    assert kept.data[0].texttemplate == "%{z:.2f}" and kept.layout.height >= 30 * 40
