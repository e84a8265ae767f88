"""Results in a Jupyter notebook, offline: plotly.js travels inside the notebook, never fetched.

A notebook shows a Result through its `_repr_html_`. Its plotly figures need plotly.js (about 4.8 MB); the
first output of a kernel session that draws a figure carries the whole bundle (`plotly_once`), which sets
`window.Plotly` for every later output of the page, and later outputs carry only their figures. The bundle
is the installed plotly package's own (`plotly.offline.get_plotlyjs`), so nothing is fetched from a network:
a notebook executed offline and opened offline shows every figure. A frontend that isolates each output
in its own frame (Colab) needs the bundle in every output: `entoscope.results.notebook.EVERY_OUTPUT = True`.
"""

from __future__ import annotations

EVERY_OUTPUT = False  # put plotly.js into every output (frontends whose outputs do not share one page)
_SENT = [False]  # whether this kernel session has sent the bundle


def plotly_once() -> str:
    """The script tag that defines `window.Plotly` the first time a kernel session asks (or always with
    EVERY_OUTPUT); '' after that. An output that loads it again (EVERY_OUTPUT) keeps the Plotly it finds."""
    if _SENT[0] and not EVERY_OUTPUT:
        return ""
    from plotly.offline import get_plotlyjs

    _SENT[0] = True
    bundle = get_plotlyjs().replace("</script", "<\\/script")
    return ("<script type=\"text/javascript\">window.PlotlyConfig = {MathJaxConfig: 'local'};"
            f"if (!window.Plotly) {{\n{bundle}\n}}</script>")
