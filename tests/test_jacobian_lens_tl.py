"""One file format and one estimator with TransformerLens 4.3's `JacobianLens` (skipped where transformer-lens
has none, as on the 3.x CI pass): the same lens fitted both ways on the demo model, files read both ways, and
the same readout logits."""

import pytest
import torch

import entoscope as es
from entoscope.lens.project import decode_states
from entoscope.models.adapter import adapt
from entoscope.models.names import ActName

analysis = pytest.importorskip("transformer_lens.tools.analysis")
if not hasattr(analysis, "JacobianLens"):
    pytest.skip("this transformer-lens has no JacobianLens (4.3 has)", allow_module_level=True)
TLJacobianLens = analysis.JacobianLens


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


@pytest.fixture(scope="module")
def corpus():
    return es.tasks.get("corpus", n=4, seed=3)


@pytest.fixture(scope="module")
def fitted(demo, corpus):
    ours = es.JacobianLens.fit(demo, corpus, max_length=64, quiet=True)
    theirs = TLJacobianLens.fit(demo, [ex.prompt for ex in corpus], corpus="corpus", max_seq_len=64,
                                show_progress=False)
    return ours, theirs


def test_the_same_lens_fitted_both_ways(fitted):
    ours, theirs = fitted
    assert ours.source_layers == theirs.source_layers == [0, 1] and ours.n_prompts == theirs.n_prompts == 4
    for layer in ours.source_layers:  # float32 summation order only (entries are O(1))
        torch.testing.assert_close(ours.jacobians[layer], theirs.jacobians[layer], atol=1e-5, rtol=1e-5)


def test_ours_loads_in_transformer_lens_with_the_same_readout(fitted, demo, corpus, tmp_path):
    ours, _ = fitted
    path = ours.save(tmp_path / "lens")
    loaded = TLJacobianLens.load(str(path))  # TransformerLens's own reader and model validation
    a = adapt(demo)
    ids = a.tokenize(corpus[1].prompt)[:60]  # within the demo model's context of 64
    tokens = torch.tensor([ids])
    readout = loaded.readout(demo, tokens, return_full_logits=True)
    lens = es.JacobianLens.load(tmp_path / "lens")
    lens.check_model(a)
    for layer in (0, 1):
        h = a.run(tokens, [ActName("resid_post", layer)]).acts[ActName("resid_post", layer)][0]
        mine = decode_states(a, lens.transform(h, lens.index_of(ActName("resid_post", layer)))).float()
        torch.testing.assert_close(mine, readout.lens_logits[layer], atol=2e-4, rtol=1e-4)
    # the lens operation's top-1 tokens at every position are TransformerLens's
    r = es.Lens(method="jacobian", lens=str(tmp_path / "lens"), top_k=1,
                sites=es.Sites(activation="resid_post", over=["layer", "position"])).run(demo, [tuple(ids)], quiet=True)
    pp = r.per_prompt
    for layer in (0, 1):
        rows = pp[pp["layer"] == layer].sort_values("token_position")
        want = [demo.tokenizer.decode([int(i)]) for i in readout.lens_topk_indices[layer][:, 0]]
        assert rows["top1_token"].tolist() == want


def test_a_transformer_lens_file_loads_here(fitted, demo, tmp_path):
    _, theirs = fitted
    theirs.save(str(tmp_path / "tl.pt"))
    lens = es.JacobianLens.load(tmp_path / "tl.pt")
    assert lens.n_prompts == 4 and lens.metadata["corpus"] == "corpus"
    for layer in (0, 1):
        assert torch.equal(lens.jacobians[layer], theirs.jacobians[layer].half().float())
    r = es.Lens(method="jacobian", lens=str(tmp_path / "tl.pt"),
                sites=es.Sites(activation="resid_post", over=["layer"])).run(demo, es.tasks.get("ioi", n=4), quiet=True)
    assert r.table.loc[r.table["layer"] == 2, "kl_mean"].iloc[0] == 0  # the last layer: the model's own output
