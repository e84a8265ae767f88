"""The walkthrough notebook runs from top to bottom (nbclient), and every Result it shows displays its
takeaway, figure and table."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a kernel executing the notebook: tens of seconds (CI runs it: -m slow)

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "walkthrough.ipynb"


def test_walkthrough_notebook_executes_and_results_display_themselves(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    html_outputs = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                    if "text/html" in o.get("data", {})]
    shown = [h for h in html_outputs if "plotly-graph-div" in h]
    assert len(shown) >= 3  # the lens, the patching and the circuit Results
    assert all("<table" in h for h in shown)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
