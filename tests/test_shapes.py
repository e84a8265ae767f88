"""benchmarks/shapes.py builds real models' shapes from their published configurations: the parameter counts
(tied embeddings once) against the counts the models' publishers give (their safetensors' totals), built on the
meta device (no memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import shapes  # noqa: E402

PUBLISHED = {  # the model cards' / safetensors' parameter totals
    "smollm2-135m": 134_515_008,
    "gemma-3-270m": 268_098_176,
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.2-1b": 1_235_814_400,
    "gemma-2-2b": 2_614_341_888,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_shape_has_its_published_models_parameter_count(name):
    assert shapes.parameters(name) == PUBLISHED[name]


def test_aliases_and_an_unknown_shape():
    assert shapes.shape_name("1b") == "llama-3.2-1b" and shapes.shape_name("Gemma2") == "gemma-2-2b"
    with pytest.raises(KeyError, match="unknown shape"):
        shapes.shape_name("gpt-5")
