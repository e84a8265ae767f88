"""The report's sizes (report/sizes.py): the model's cost counted against its own weights, and the sizes the
report records (manifest.json `sizes`, the pages) equal what its sections' runs used, read from each run's own
manifest and table (the prompts an operation counted, the config it ran with)."""

from __future__ import annotations

import json

import pytest

import entoscope as es
from entoscope.report import sizes as sizes_module


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_forward_macs_is_the_weights_a_token_passes_through(demo):
    """The demo model (plain attention and MLP): every block's q, k, v, o and MLP matrices, and W_U, counted
    from the model's own parameters (the embeddings and norms are lookups and scalings, not products)."""
    from entoscope.models.adapter import adapt

    hf = adapt(demo).module.original_model  # W_U tied to wte
    # the bridge holds attention as q, k, v, o and their fused qkv (the same numbers again): qkv left out
    blocks = sum(p.numel() for name, p in hf.transformer.h.named_parameters() if p.dim() == 2 and ".qkv." not in name)
    brute = blocks + hf.lm_head.weight.numel()
    assert sizes_module.forward_macs(demo) == pytest.approx(brute)
    assert sizes_module.tier(demo) == "small"


def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture(scope="module")
def large_report(demo, tmp_path_factory):
    """The quick report's circuits, lens, patching and steering sections on the demo model counted as a large
    one (SMALL_MACS 0), with a Jacobian budget too small to fit on."""
    from entoscope.report import build_report

    folder = tmp_path_factory.mktemp("sizes") / "large"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizes_module, "SMALL_MACS", 0.0)
        mp.setattr(sizes_module, "JACOBIAN_BUDGET", {True: 1e6, False: 1e6})
        build_report(demo, folder, quick=True, sections=["circuits", "lens", "patching", "steering"], quiet=True)
    return folder


def test_recorded_sizes_are_the_ones_the_large_tier_runs_used(large_report):
    sizes = _manifest(large_report)["sizes"]
    assert sizes["tier"] == "large"
    n_edges = 262  # the demo's graph: 1 + 3 x (4 + 1) senders; (a test of its own counts them)
    for where in ("circuits", "circuits/ioi"):
        run = _manifest(large_report / where)
        assert run["config"]["method"] == sizes["circuits"]["method"] == "eap"
        assert run["data"]["n"] == sizes["circuits"]["n"]
        assert run["config"]["selection"] == "target"  # found by its faithfulness, within the large tier's budget
        assert run["config"]["max_edges"] == int(sizes["circuits"]["budget"] * n_edges) == int(0.05 * n_edges)
        assert run["config"]["search_steps"] == sizes["circuits"]["search_steps"]
    curve = _manifest(large_report / "circuits")["config"]["faithfulness"]
    assert curve == list(sizes_module.COARSE_FRACTIONS)
    page = (large_report / "index.html").read_text()
    assert "induction and IOI circuits (EAP): " in page
    assert "the edge fractions " + ", ".join(f"{f:g}" for f in curve) in page
    assert _manifest(large_report / "lens")["data"]["n"] == sizes["lens"]["n"]
    assert sizes["lens"]["jacobian_fit"] is False
    assert not (large_report / "lens" / "comparison").exists()  # no Jacobian lens fitted, and the page says so
    assert "No Jacobian lens in this report" in page
    resid = _manifest(large_report / "patching")  # where the answer sits: always exact, at the spread layers
    assert resid["config"]["method"] == "exact" and resid["data"]["n"] == sizes["patching"]["n"]
    assert resid["config"]["sites"]["layers"] == sizes["patching"]["layers"]
    for where in ("patching/example1", "patching/example2"):
        run = _manifest(large_report / where)
        assert run["config"]["method"] == sizes["patching"]["method"] == "attribution"
        assert run["data"]["n"] == sizes["patching"]["n"]
        recheck = __import__("pandas").read_csv(large_report / where / "recheck.csv")  # the exact re-check
        assert len(recheck) == sizes["patching"]["recheck"] and set(recheck["n_prompts"]) == {sizes["patching"]["n"]}
    assert "activation patching (exact and attribution, denoising)" in page
    run = _manifest(large_report / "steering")
    assert run["config"]["coefficients"] == list(sizes["steering"]["coefficients"])
    table = __import__("pandas").read_csv(large_report / "steering" / "table.csv")
    assert set(table["n_prompts"]) == {sizes["steering"]["n"]}
    assert sorted(set(table["coefficient"])) == sorted(sizes["steering"]["coefficients"])


def test_the_small_tier_keeps_the_demo_sizes_and_records_them(demo, tmp_path):
    """The demo's quick circuits section: EAP-IG, MIB's fractions, the prompts the run counted."""
    from entoscope.circuits.faithfulness import MIB_FRACTIONS
    from entoscope.report import build_report

    build_report(demo, tmp_path / "r", quick=True, sections=["circuits"], quiet=True)
    sizes = _manifest(tmp_path / "r")["sizes"]
    run = _manifest(tmp_path / "r" / "circuits")
    assert sizes["tier"] == "small"
    assert run["config"]["method"] == sizes["circuits"]["method"] == "eap_ig"
    assert run["config"]["steps"] == sizes["circuits"]["steps"]
    assert run["config"]["faithfulness"] == list(MIB_FRACTIONS)
    assert run["data"]["n"] == sizes["circuits"]["n"]


def test_probed_layers_spread_from_the_first_to_the_last_by_hand():
    # 30 layers, 8 of them: i * 29 / 7 rounded = 0, 4.1, 8.3, 12.4, 16.6, 20.7, 24.9, 29
    assert sizes_module.spread_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert sizes_module.spread_layers(3, 8) == "all"
    assert sizes_module.spread_layers(30, None) == "all"
