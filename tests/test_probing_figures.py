"""The probing page's figures at a few spread layers (the report probes a large model at 8 of its 30 layers):
one equal heatmap row and one tick per layer probed, read from the figures as the page draws them."""

from __future__ import annotations

import entoscope as es


def test_a_few_spread_layers_get_one_row_and_one_tick_each():
    """Probing at layers 0 and 2 of the demo (a few layers spread, as the report probes a large model): the
    heatmap's layer axis holds exactly those layers as categories (equal rows, no tick between them), and a
    line chart over them is ticked at those layers only."""
    from entoscope.results.figures import polish

    model = es.load_model("demo")
    op = es.Probing(sites={"activation": "resid_pre", "over": ["layer", "position"], "layers": [0, 2],
                           "positions": "-2:"}, seed=0)
    r = op.run(model, {"task": "greater_than", "n": 64, "seed": 11}, quiet=True)
    figs = dict(r.figures())
    heat = polish(next(f for title, f in figs.items() if "by layer and position" in title))
    assert heat.layout.yaxis.type == "category" and list(heat.data[0].y) == ["0", "2"]
    line = polish(next(f for title, f in figs.items() if title.startswith("held-out")))
    assert list(line.layout.xaxis.tickvals) == [0, 2]
