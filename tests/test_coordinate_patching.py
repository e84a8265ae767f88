"""Coordinate patching (lens/coordinate_patch.py) and the lens comparison as an operation (lens/compare.py):
an empty edit is the identity; an edit by hand on hand-made lens vectors; the edited run against
TransformerLens 4.3's own `JacobianLens.coordinate_patch` and a `run_with_hooks` forward; the control against
its definition, recomputed from an independent decomposition; a lens fitted in the run against the same lens
given as a file."""

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.errors import EntoscopeError
from entoscope.lens.coordinate_patch import control_delta, coordinate_change, edit_delta
from entoscope.lens.jspace import Atoms, decompose
from entoscope.models.adapter import adapt
from entoscope.models.names import ActName

IOI = {"task": "ioi", "n": 6, "seed": 2}
LAYER = 1


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.fixture(scope="module")
def lens_file(demo, tmp_path_factory):
    lens = es.JacobianLens.fit(demo, es.tasks.get("corpus", n=2, seed=3), skip_first=4, max_length=48, quiet=True)
    return str(lens.save(tmp_path_factory.mktemp("jlens") / "lens", dtype=torch.float32))


@pytest.fixture(scope="module")
def swapped(demo, lens_file):
    op = es.CoordinatePatching(lens=lens_file, sites=es.Sites(activation="resid_post", over=["layer"],
                                                              layers=[LAYER], positions=[-1]), k=12,
                               stats={"n_boot": 200})
    return op.run(demo, IOI, quiet=True)


def test_an_edit_of_nothing_is_the_identity(demo, lens_file):
    r = es.CoordinatePatching(lens=lens_file, alpha=0.0, k=8, stats={"n_boot": 200}).run(demo, IOI, quiet=True)
    pp = r.per_prompt
    assert (pp["coef_answer"] > 0).any()  # there was something to edit
    # bit for bit: the edited and control runs give the unedited run's metric
    assert (pp["metric_edited"] == pp["metric_base"]).all() and (pp["metric_control"] == pp["metric_base"]).all()
    assert (r.table["effect"] == 0).all() and not r.table["beats_control"].any()


def test_an_edit_by_hand_on_hand_made_lens_vectors():
    """x = 2 a0 + 3 a1 + r, r orthogonal to every atom: the decomposition is {a0: 2, a1: 3} with error |r| / |x|
    (scipy's NNLS on the support gives the same); with A = 0 and W = 1: swap -> 3 a0 + 2 a1 + r, substitute (c_W
    <- c_A, c_A <- 0) -> 2 a1 + r, remove -> 3 a1 + r."""
    from scipy.optimize import nnls

    atoms = torch.zeros(5, 6, dtype=torch.float64)
    atoms[0, 0], atoms[1, 1], atoms[2, 2], atoms[3, 3] = 1.0, 2.0, 1.0, 1.0  # a1 has norm 2
    atoms[4, :2] = torch.tensor([1.0, 1.0])
    r = torch.zeros(6, dtype=torch.float64)
    r[5] = 0.5
    x = 2 * atoms[0] + 3 * atoms[1] + r
    d = decompose(x, atoms, k=5)
    coef = dict(zip(d.support, d.coefficients))
    assert coef == pytest.approx({0: 2.0, 1: 3.0})
    brute, _ = nnls(atoms[[0, 1]].T.numpy(), x.numpy())
    assert brute == pytest.approx([2.0, 3.0])
    assert d.error == pytest.approx(0.5 / float(x.norm()))
    A = Atoms.of(atoms)
    for edit, expected in (("swap", 3 * atoms[0] + 2 * atoms[1]), ("substitute", 2 * atoms[1]),
                           ("remove", 3 * atoms[1])):
        tokens, change = coordinate_change(coef, 0, 1, edit, 1.0)
        torch.testing.assert_close(x + edit_delta(A, tokens, change), expected + r)
    tokens, change = coordinate_change(coef, 0, 1, "swap", 0.5)  # alpha halves every change
    torch.testing.assert_close(x + edit_delta(A, tokens, change), 2.5 * atoms[0] + 2.5 * atoms[1] + r)
    # the control: coordinates 2 and 3 (norm 1) moved by dc_i |a_{t_i}|: +1 * 1 along a2, -1 * 2 along a3
    torch.testing.assert_close(control_delta(A, [0, 1], np.array([1.0, -1.0]), [2, 3]), atoms[2] - 2 * atoms[3])
    assert coordinate_change({}, 0, 1, "swap", 1.0)[1].tolist() == [0.0, 0.0]  # neither in the support: no edit


def _tl_run(demo, tokens, layer, pos, patched):
    """The logits at the last token of a TransformerLens run_with_hooks forward with blocks.L.hook_out
    replaced at `pos` by `patched`."""
    def hook(x, hook):
        x = x.clone()
        x[0, pos] = patched.to(x.dtype)
        return x
    with torch.no_grad():
        return demo.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_out", hook)])[0, -1]


def test_the_edited_run_is_transformer_lens_coordinate_patch_run_on(demo, lens_file, swapped):
    analysis = pytest.importorskip("transformer_lens.tools.analysis")
    if not hasattr(analysis, "JacobianLens"):
        pytest.skip("this transformer-lens has no JacobianLens (4.3 has)")
    tl_lens = analysis.JacobianLens.load(lens_file)
    a = adapt(demo)
    data = es.load_data(IOI)
    pp = swapped.per_prompt
    checked = 0
    for i, ex in enumerate(data):
        row = pp[pp["example"] == i].iloc[0]
        if row["coef_answer"] <= 0:
            continue  # TransformerLens patches only an answer in the active support
        ids = a.tokenize(ex.prompt)
        tokens = torch.tensor([ids])
        with torch.no_grad():
            h = demo.run_with_cache(tokens)[1][f"blocks.{LAYER}.hook_out"][0, -1]
        ans, wrong = (a.tokenize(w, prepend_bos=False)[0] for w in (ex.answers[0], ex.wrong_answers[0]))
        patch = tl_lens.coordinate_patch(demo, h, LAYER, ans, wrong, mode="swap", k=12)
        logits = _tl_run(demo, tokens, LAYER, len(ids) - 1, patch.patched)
        assert row["metric_edited"] == pytest.approx(float(logits[ans] - logits[wrong]), abs=2e-3)
        checked += 1
    assert checked >= 2


def test_the_control_moves_as_many_support_coordinates_as_far(demo, lens_file, swapped):
    """Each prompt's control tokens are two tokens of its decomposition's support other than the answer and the
    wrong answer (decomposed again here by jspace.decompose on the lens vectors), and the control run is a
    run_with_hooks forward with x + sum_i dc_i |a_{t_i}| a_{r_i} / |a_{r_i}| at the last token."""
    lens = es.JacobianLens.load(lens_file)
    a = adapt(demo)
    vectors = lens.lens_vectors(demo, LAYER).double()
    data = es.load_data(IOI)
    pp = swapped.per_prompt
    for i, ex in enumerate(data):
        row = pp[pp["example"] == i].iloc[0]
        ids = a.tokenize(ex.prompt)
        tokens = torch.tensor([ids])
        h = a.run(tokens, [ActName("resid_post", LAYER)]).acts[ActName("resid_post", LAYER)][0, -1]
        d = decompose(h, vectors, k=12)
        ans, wrong = (a.tokenize(w, prepend_bos=False)[0] for w in (ex.answers[0], ex.wrong_answers[0]))
        coef = dict(zip(d.support, d.coefficients))
        assert row["coef_answer"] == pytest.approx(coef.get(ans, 0.0), rel=1e-5, abs=1e-6)
        assert row["support_size"] == len(d.support)
        drawn = [int(t) for t in row["control_ids"].split()]
        assert len(drawn) == 2 and len(set(drawn)) == 2
        assert set(drawn) <= set(d.support) - {ans, wrong}
        change = np.array([coef.get(wrong, 0.0) - coef.get(ans, 0.0), coef.get(ans, 0.0) - coef.get(wrong, 0.0)])
        norms = vectors.norm(dim=1)
        delta = sum(change[j] * norms[t] / norms[r] * vectors[r] for j, (t, r) in enumerate(zip([ans, wrong], drawn)))
        logits = _tl_run(demo, tokens, LAYER, len(ids) - 1, h.double() + delta)
        assert row["metric_control"] == pytest.approx(float(logits[ans] - logits[wrong]), abs=2e-3)


def test_the_page_says_what_the_table_holds(swapped, tmp_path):
    t = swapped.table
    row = t.iloc[0]
    assert row["site"] in swapped.takeaway and "beats" in swapped.takeaway
    low, high = row["effect_ci_low"], row["effect_ci_high"]
    assert low <= row["effect"] <= high
    pp = swapped.per_prompt
    assert row["effect"] == pytest.approx((pp["metric_edited"] - pp["metric_base"]).mean())
    assert row["minus_control"] == pytest.approx((pp["metric_edited"] - pp["metric_control"]).mean())
    assert row["answer_in_support"] == pytest.approx((pp["coef_answer"] > 0).mean())
    swapped.save(tmp_path / "run")
    page = (tmp_path / "run" / "index.html").read_text()
    assert (tmp_path / "run" / "takeaway.json").exists() and "Jacobian lens" in page


def test_refusals(demo, lens_file):
    pre = es.Sites(activation="resid_pre", over=["layer"])
    for op, data, code in ((es.CoordinatePatching(lens=lens_file, sites=pre), IOI, "jacobian_lens_site"),
                           (es.CoordinatePatching(lens=lens_file), ["a prompt without answers"], "data_no_answers"),
                           (es.CoordinatePatching(fit_data=None), IOI, "jacobian_lens_missing")):
        with pytest.raises(EntoscopeError) as err:
            op.plan(demo, data)
        assert err.value.code == code


def test_a_lens_fitted_in_the_comparison_is_the_lens_given_as_a_file(demo, tmp_path):
    settings = dict(skip_first=4, max_length=16, layers=[0, 1])
    texts = ["the cat sat on the mat and then the dog ran to the park"] * 2
    lens = es.JacobianLens.fit(demo, texts, quiet=True, **settings)
    path = lens.save(tmp_path / "l", dtype=torch.float32)
    common = dict(stats={"n_boot": 200})
    fitted = es.LensComparison(fit_data=texts, fit_skip_first=4, fit_max_length=16, **common).run(demo, IOI, quiet=True)
    given = es.LensComparison(lens=str(path), **common).run(demo, IOI, quiet=True)
    f, g = (r.table[r.table["lens"] == "jacobian"].reset_index(drop=True) for r in (fitted, given))
    np.testing.assert_allclose(f["kl_mean"], g["kl_mean"], rtol=1e-5, atol=1e-6)
    assert (f["agree"] == g["agree"]).all()
    assert "fitted in this run" in fitted.takeaway and "fitted in this run" not in given.takeaway
    assert list(fitted.table["lens"].unique()) == ["logit", "jacobian"]
    none = es.LensComparison(fit_data=None, **common).run(demo, IOI, quiet=True)
    assert list(none.table["lens"].unique()) == ["logit"]


def test_every_number_and_word_of_both_takeaways_is_read_back_from_the_saved_tables(demo, lens_file, tmp_path):
    """Each saved takeaway.json's quotes are table.csv's cells, its counts the table's rows, its "largest" the row of
    largest |effect|, its "beats" / "does not beat" the rule of docs/pages.md read from the quoted intervals."""
    import json

    import pandas as pd

    runs = {"swap": es.CoordinatePatching(lens=lens_file, stats={"n_boot": 300}),
            "remove": es.CoordinatePatching(lens=lens_file, edit="remove", stats={"n_boot": 300}),
            "lenses": es.LensComparison(lens=lens_file, stats={"n_boot": 300})}
    for name, op in runs.items():
        folder = op.run(demo, {"task": "ioi", "n": 12, "seed": 3}, quiet=True).save(tmp_path / name)
        table = pd.read_csv(folder / "table.csv")
        [entry] = json.loads((folder / "takeaway.json").read_text())
        claims = entry["claims"]
        for c in claims:
            assert entry["text"][c["start"]:c["start"] + len(c["text"])] == c["text"]
            if c["type"] == "quote":
                hit = np.ones(len(table), dtype=bool)
                for k, v in c["row"].items():
                    hit &= table[k].astype(str).to_numpy() == str(v)
                row = table[hit].iloc[0]
                assert row[c["column"]] == pytest.approx(c["value"], abs=1e-9)
                if c["low"] is not None:
                    assert (row[c["column"] + "_ci_low"], row[c["column"] + "_ci_high"]) == \
                        pytest.approx((c["low"], c["high"]), abs=1e-9)
            elif c["type"] == "count":
                assert c["value"] == int(table[c["column"]].astype(bool).sum()) and c["total"] == len(table)
            elif c["type"] == "qualifier":
                refs = [claims[i] for i in c["refs"]]
                if c["rule"] == "top_by_abs":
                    assert abs(refs[0]["value"]) == pytest.approx(table[refs[0]["column"]].abs().max())
                elif c["rule"] in ("beats_random", "not_beats_random"):
                    effect, minus = refs
                    shown = effect["low"] > 0 or effect["high"] < 0
                    same_side = minus["low"] > 0 if effect["value"] > 0 else minus["high"] < 0
                    assert (shown and same_side) == (c["rule"] == "beats_random")
                elif c["rule"] in ("most", "not_most"):
                    held = all(r["value"] >= 0.5 and r["low"] > 0.5 for r in refs)
                    assert held == (c["rule"] == "most")
                elif c["rule"] in ("settled", "unsettled"):  # docs/lens.md: every layer's split-half change < 0.1
                    frame = pd.read_csv(folder / refs[0]["source"])
                    worst = frame["split_half_change"].max()
                    assert refs[0]["value"] == pytest.approx(worst)
                    assert (worst < 0.1) == (c["rule"] == "settled")
                else:
                    raise AssertionError(f"a rule this test does not know: {c['rule']}")
