"""The lens comparison and coordinate patching on SmolLM2-135M (the `real` marker; scripts/check_lens_comparison_real.py
has the larger run whose numbers docs/lens.md quotes): a Jacobian lens fitted in the run, its agreement against a
direct readout, and the edited run at the last layer against a run_with_hooks forward with the edit by hand."""

from __future__ import annotations

import pytest
import torch

import entoscope as es
from entoscope.lens.jspace import decompose
from entoscope.lens.project import decode_states
from entoscope.models.adapter import adapt
from entoscope.models.names import ActName

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    return es.load_model(smollm2_folder)


@pytest.fixture(scope="module")
def ioi(smollm2):
    return es.tasks.get("ioi", n=6, seed=1, tokenizer=smollm2.tokenizer)


def test_the_comparison_with_a_lens_fitted_in_the_run(smollm2, ioi):
    a = adapt(smollm2)
    L = a.structure.n_layers
    r = es.LensComparison(layers=[L - 3, L - 1], fit_data={"task": "corpus", "n": 1, "seed": 5},
                          fit_max_length=20, fit_skip_first=8, stats={"n_boot": 200}).run(smollm2, ioi, quiet=True)
    t = r.table.set_index(["lens", "layer"])
    assert list(r.table["lens"].unique()) == ["logit", "jacobian"] and "fitted in this run" in r.takeaway
    for lens in ("logit", "jacobian"):  # the last layer is the model's own output
        assert t.loc[(lens, L - 1), "agree"] == 1 and abs(t.loc[(lens, L - 1), "kl_mean"]) < 1e-5
    lens = r.extra["jacobian_lens"]
    hits = 0
    for ex in ioi:
        out = a.run(torch.tensor([a.tokenize(ex.prompt)]), [ActName("resid_post", L - 3)])
        h = out.acts[ActName("resid_post", L - 3)][0, -1]
        hits += int(decode_states(a, lens.transform(h, L - 3)).argmax() == out.logits[0, -1].argmax())
    assert t.loc[("jacobian", L - 3), "agree"] == pytest.approx(hits / len(ioi))


def test_an_edit_at_the_last_layer_is_the_edit_by_hand_run_on(smollm2, ioi, tmp_path):
    """At the last block's output the lens vectors are the unembedding's columns. SmolLM2's last state is mostly one
    massive dimension that no nonnegative combination of them explains (relative error ~0.97), and the IOI names are
    rarely in the support; so each prompt's answer and wrong answer here are two tokens of its support (decomposed
    here, independently): the swap computed by hand, run on through TransformerLens's run_with_hooks."""
    from entoscope.data import Dataset, Example

    a = adapt(smollm2)
    L = a.structure.n_layers
    lens = es.JacobianLens.fit(smollm2, [ex.prompt for ex in ioi][:1], layers=[L - 2], skip_first=4, max_length=12,
                               quiet=True)
    path = lens.save(tmp_path / "lens")
    vectors = a.weights.W_U.detach().double().T
    cases, examples = [], []
    for ex in ioi:
        ids = a.tokenize(ex.prompt)
        h = a.run(torch.tensor([ids]), [ActName("resid_post", L - 1)]).acts[ActName("resid_post", L - 1)][0, -1]
        d = decompose(h, vectors, k=8)
        ans, wrong = d.support[1], d.support[2]
        coef = dict(zip(d.support, d.coefficients))
        cases.append((ids, h, ans, wrong, coef[ans], coef[wrong]))
        examples.append(Example(tuple(ids), answers=(ans,), wrong_answers=(wrong,)))
    data = Dataset("support-pairs", tuple(examples))
    sites = es.Sites(activation="resid_post", over=["layer"], layers=[L - 1], positions=[-1])
    r = es.CoordinatePatching(lens=str(path), sites=sites, k=8, stats={"n_boot": 200}).run(smollm2, data, quiet=True)
    pp = r.per_prompt
    for i, (ids, h, ans, wrong, ca, cw) in enumerate(cases):
        row = pp[pp["example"] == i].iloc[0]
        assert row["coef_answer"] == pytest.approx(ca, rel=1e-4) and row["coef_wrong"] == pytest.approx(cw, rel=1e-4)
        patched = h.double() + (cw - ca) * vectors[ans] + (ca - cw) * vectors[wrong]

        def hook(x, hook, patched=patched, pos=len(ids) - 1):
            x = x.clone()
            x[0, pos] = patched.to(x.dtype)
            return x
        with torch.no_grad():
            logits = smollm2.run_with_hooks(torch.tensor([ids]), fwd_hooks=[(f"blocks.{L - 1}.hook_out", hook)])[0, -1]
        assert row["metric_edited"] == pytest.approx(float(logits[ans] - logits[wrong]), abs=5e-3)
        assert row["metric_edited"] != pytest.approx(row["metric_base"], abs=1e-3)  # the edit changed something
    assert (r.table["answer_in_support"] == 1).all() and r.table["site"].iloc[0] in r.takeaway
