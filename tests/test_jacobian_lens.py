"""The Jacobian lens (lens/jacobian.py, lens/jacobian_fit.py): the fit against a brute-force Jacobian on
every model kind, merging, the file format and readout against TransformerLens 4.3's own JacobianLens."""

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.errors import EntoscopeError
from entoscope.models.adapter import Intervention, adapt
from entoscope.models.names import ActName

from conftest import get_tiny


def _texts(n: int, T: int, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    lengths = [T - (i % 3) for i in range(n)]  # different lengths: right padding must not change a prompt's matrix
    return Dataset("random", tuple(Example(tuple([0] + torch.randint(1, 300, (L - 1,), generator=g).tolist()))
                                   for L in lengths))


def _brute_force(model, ids, layer: int, skip: int) -> torch.Tensor:
    """(1/|V|) sum_{t in V} sum_{t' in V} d final[t'] / d h_layer[t], from the full Jacobian of one prompt's run
    (torch.autograd.functional.jacobian of the map resid_post.layer -> last resid_post)."""
    a = adapt(model)
    L = a.structure.n_layers
    tokens = torch.tensor([ids])
    h0 = a.run(tokens, [ActName("resid_post", layer)]).acts[ActName("resid_post", layer)][0].detach()

    def f(x):
        iv = Intervention(ActName("resid_post", layer), lambda _: x[None])
        return a.run(tokens, [ActName("resid_post", L - 1)], interventions=[iv], grad=True).acts[
            ActName("resid_post", L - 1)][0]

    full = torch.autograd.functional.jacobian(f, h0)  # [T, d, T, d]: out position, out dim, in position, in dim
    V = list(range(skip, len(ids) - 1))
    return sum(full[t2, :, t, :] for t in V for t2 in V) / len(V)


@pytest.mark.parametrize("variant", [("gpt2", "bridge", False), ("llama", "bridge", True), ("neox", "bridge", False),
                                     ("gpt2", "hooked", False)], ids=lambda v: "-".join(map(str, v)))
def test_the_fit_is_the_mean_of_brute_force_jacobians(variant):
    if variant[1] == "hooked":
        pytest.importorskip("transformer_lens.HookedTransformer", reason="transformer-lens 4.x has no HookedTransformer")
    model = get_tiny(*variant)
    data = _texts(3, 9)
    lens = es.JacobianLens.fit(model, data, skip_first=2, dim_chunk=24, quiet=True)  # 64 = 24 + 24 + 16
    assert lens.source_layers == [0] and lens.n_prompts == 3
    a = adapt(model)
    ids = [a.tokenize(ex.prompt) for ex in data]
    expect = sum(_brute_force(model, i, 0, 2) for i in ids) / 3
    torch.testing.assert_close(lens.jacobians[0], expect.float(), atol=2e-5, rtol=1e-4)
    t = lens.fit_result.table
    assert t["positions"].iloc[0] == sum(len(i) - 1 - 2 for i in ids)


def test_merging_halves_equals_one_fit_and_other_provenance_is_refused(tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    data = _texts(6, 8)
    whole = es.JacobianLens.fit(model, data, skip_first=1, corpus="c", quiet=True)
    parts = [es.JacobianLens.fit(model, data[s], skip_first=1, corpus="c", quiet=True) for s in (slice(0, 2), slice(2, 6))]
    merged = es.JacobianLens.merge(parts)
    assert merged.n_prompts == 6
    torch.testing.assert_close(merged.jacobians[0], whole.jacobians[0], atol=1e-6, rtol=0)  # float32 rounding
    other = es.JacobianLens.fit(model, data[:2], skip_first=2, corpus="c", quiet=True)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLens.merge([parts[0], other])
    assert err.value.code == "jacobian_merge_mismatch" and "skip_first_positions" in str(err.value)
    # settledness: the relative change between even- and odd-numbered prompts, recomputed from two fits
    even = es.JacobianLens.fit(model, data[0::2], skip_first=1, quiet=True).jacobians[0]
    odd = es.JacobianLens.fit(model, data[1::2], skip_first=1, quiet=True).jacobians[0]
    assert whole.settledness[0] == pytest.approx(float((even - odd).norm() / whole.jacobians[0].norm()), rel=1e-4)


def test_a_sharded_fit_with_resume_equals_the_in_process_fit(tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    data = _texts(6, 8)
    op = es.JacobianLensFit(skip_first=1, batch_size=2)
    one = op.run(model, data, quiet=True).extra["lens"]
    op.run(model, data, quiet=True, shards_dir=tmp_path / "s")
    again = op.run(model, data, quiet=True, shards_dir=tmp_path / "s", resume=True).extra["lens"]
    assert torch.equal(one.jacobians[0], again.jacobians[0])


def test_short_prompts_and_wrong_sites_are_refused():
    model = get_tiny("gpt2", "bridge", False)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLensFit().plan(model, _texts(2, 8))  # skip_first 16 > 8 tokens
    assert err.value.code == "jacobian_prompts_too_short"
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLensFit(layers=[1]).plan(model, _texts(2, 20))  # layer 1 is the last: the target
    assert err.value.code == "jacobian_layers"


def test_a_lens_is_refused_on_another_mode(tmp_path):
    plain = get_tiny("gpt2", "bridge", False)
    es.JacobianLens.fit(plain, _texts(2, 8), skip_first=1, quiet=True).save(tmp_path / "l")
    with pytest.raises(EntoscopeError) as err:
        es.Lens(method="jacobian", lens=str(tmp_path / "l")).plan(get_tiny("gpt2", "bridge", True), _texts(2, 8))
    assert err.value.code == "jacobian_lens_mismatch"
    with pytest.raises(EntoscopeError) as err:
        es.Lens(method="jacobian", lens=str(tmp_path / "l"),
                sites=es.Sites(activation="resid_pre", over=["layer"])).plan(plain, _texts(2, 8))
    assert err.value.code == "jacobian_lens_site"  # resid_pre.0 is the embedding: no matrix


def test_the_side_by_side_comparison_counts_agreement_like_a_direct_readout(tmp_path):
    from entoscope.lens.compare import compare_lenses
    from entoscope.lens.project import decode_states

    model = get_tiny("gpt2", "bridge", False)
    lens = es.JacobianLens.fit(model, _texts(4, 10), skip_first=1, quiet=True)
    lens.save(tmp_path / "j")
    data = _texts(12, 7, seed=4)
    r = compare_lenses(model, data, jacobian=str(tmp_path / "j"))
    t = r.table.set_index(["lens", "layer"])
    assert t.loc[("logit", 1), "agree"] == 1 and t.loc[("jacobian", 1), "kl_mean"] == 0  # the last layer is the model
    # the Jacobian lens at layer 0, by hand: argmax of W_U norm(J h) + b_U against argmax of the logits, at END
    a = adapt(model)
    lens.check_model(a)
    hits = 0
    for ex in data:
        tokens = torch.tensor([list(ex.prompt)])
        out = a.run(tokens, [ActName("resid_post", 0)])
        h = out.acts[ActName("resid_post", 0)][0, -1]
        hits += int(decode_states(a, lens.transform(h, 0)).argmax() == out.logits[0, -1].argmax())
    assert t.loc[("jacobian", 0), "agree"] == pytest.approx(hits / 12)
    assert t.loc[("jacobian", 0), "agree_ci_low"] <= hits / 12 <= t.loc[("jacobian", 0), "agree_ci_high"]
    assert "layer" in r.takeaway and "jacobian lens" in r.takeaway
    assert set(r.table["lens"]) == {"logit", "jacobian"}  # no tuned lens given: the title names only these two
    assert r.title.startswith("logit and Jacobian lenses side by side") and "tuned" not in r.title


def test_decompose_recovers_a_planted_sparse_combination():
    from entoscope.lens.jspace import decompose

    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(300, 64, generator=g)
    x = 2.0 * atoms[3] + 0.5 * atoms[7] + 1.2 * atoms[150]
    d = decompose(x, atoms, k=10)
    assert set(d.support) == {3, 7, 150} and d.error < 1e-6
    assert dict(zip(d.support, d.coefficients)) == pytest.approx({3: 2.0, 7: 0.5, 150: 1.2}, abs=1e-6)
    assert set(d.support) <= set(d.selected) and len(d.selected) <= 10
    d1 = decompose(x, atoms, k=1)  # k is an upper bound
    assert len(d1.selected) == 1 and 0 < d1.error < 1
    neg = decompose(-atoms[5], atoms[5:6], k=1)  # nothing positively correlated: nothing selected
    assert neg.selected == [] and neg.error == pytest.approx(1.0)


def test_decompose_matches_transformer_lens_on_lens_vectors():
    analysis = pytest.importorskip("transformer_lens.tools.analysis.jacobian_lens_decomposition")
    model = get_tiny("gpt2", "bridge", False)
    lens = es.JacobianLens.fit(model, _texts(3, 10), skip_first=1, quiet=True)
    a = adapt(model)
    h = a.run(torch.tensor([list(_texts(1, 9, seed=9)[0].prompt)]), [ActName("resid_post", 0)]).acts[
        ActName("resid_post", 0)][0, -1]
    mine = lens.decompose(model, h, 0, k=8)
    theirs = analysis.get_sparse_decomposition(h, lens.lens_vectors(model, 0), 8)
    assert mine.selected == theirs.selected_support.tolist() and mine.support == theirs.support.tolist()
    torch.testing.assert_close(torch.tensor(mine.coefficients, dtype=torch.float64), theirs.coordinates.double(),
                               atol=1e-4, rtol=1e-4)


def test_the_comparison_page_states_the_tables_agreement_and_from_which_layer_each_lens_is_informative(tmp_path):
    """Every layer's agreement of the logit lens counted by a direct argmax; its interval against the score
    test's definition (the proportions pi with |p - pi| <= z sqrt(pi (1 - pi) / n), by a grid); the first
    informative layer by hand; each number of the saved takeaway read back from the saved table."""
    import json
    from statistics import NormalDist

    import numpy as np
    import pandas as pd

    from entoscope.lens.compare import compare_lenses
    from entoscope.lens.project import decode_states

    model = es.load_model("demo")  # its logit lens is uninformative at layer 0: the first layer is not trivial
    data = _texts(16, 6, seed=5)
    r = compare_lenses(model, data)
    t = r.table.set_index(["lens", "layer"])
    a = adapt(model)
    L = a.structure.n_layers
    z = NormalDist().inv_cdf(0.975)
    grid = np.linspace(0, 1, 200001)
    passes = []
    for layer in range(L):
        hits = 0
        for ex in data:
            out = a.run(torch.tensor([list(ex.prompt)]), [ActName("resid_post", layer)])
            h = out.acts[ActName("resid_post", layer)][0, -1]
            hits += int(decode_states(a, h).argmax() == out.logits[0, -1].argmax())
        p, n = hits / 16, 16
        inside = grid[np.abs(p - grid) <= z * np.sqrt(grid * (1 - grid) / n) + 1e-12]
        row = t.loc[("logit", layer)]
        assert row["agree"] == pytest.approx(p)
        assert row["agree_ci_low"] == pytest.approx(inside.min(), abs=1e-4)
        assert row["agree_ci_high"] == pytest.approx(inside.max(), abs=1e-4)
        passes.append(p >= 0.5 and inside.min() > 0.5)
    first = next(i for i in range(L) if all(passes[i:]))
    assert first > 0
    assert (r.table["informative_from"] == first).all()
    r.save(tmp_path / "cmp")
    saved = pd.read_csv(tmp_path / "cmp" / "table.csv")
    [entry] = json.loads((tmp_path / "cmp" / "takeaway.json").read_text())
    assert f"most prompts from layer {first} on through the logit lens" in entry["text"]
    quotes = [c for c in entry["claims"] if c["type"] == "quote"]
    assert {int(c["row"]["layer"]) for c in quotes if c["column"] == "agree"} == set(range(first, L))
    for c in quotes:
        cell = saved[(saved["lens"] == c["row"]["lens"]) & (saved["layer"] == int(c["row"]["layer"]))].iloc[0]
        assert cell[c["column"]] == pytest.approx(c["value"]) and format(c["value"], c["fmt"]) in c["text"]
