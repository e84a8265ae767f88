"""Every example file runs: each entry of examples/*.yaml on the demo model (few prompts), saved with its
page, table and manifest; and every operation has an example."""

from __future__ import annotations

import json

import pandas as pd

from entoscope.registry import names


def test_every_example_entry_runs_and_saves(example_runs):
    assert len(example_runs) >= 20
    for (file, entry), folder in example_runs.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        table = pd.read_parquet(folder / "table.parquet")
        assert len(table) > 0 and (folder / "index.html").exists(), (file, entry)
        assert manifest["config"] and manifest["operation"] in names("operation")


def test_every_operation_has_an_example(example_runs):
    ops = {json.loads((f / "manifest.json").read_text())["operation"] for f in example_runs.values()}
    assert set(names("operation")) <= ops, set(names("operation")) - ops
