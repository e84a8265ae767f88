"""Interchange interventions and DAS (docs/interchange.md), checked against things the code does not compute:
a model built with a planted variable (its residual stream carries a known direction that decides the
output), the interchange's algebra written out by hand, and TransformerLens 4.3's own fit_das."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.errors import ConfigError
from entoscope.interchange import bases as B

D = 64
VALUE_TOKENS = {0: list(range(40, 52)), 1: list(range(60, 72))}
OUTPUTS = (5, 6)  # the output token of value 0, of value 1
FILLERS = list(range(80, 100))


def planted(backend: str = "bridge", compat: bool = False) -> tuple[object, np.ndarray]:
    """A 2-layer GPT-2 whose blocks write nothing (attention and MLP output weights 0), so every residual is
    the token's embedding; a value token's embedding is +-2 u plus a nuisance part (in 4 directions orthogonal to u), the
    final norm is made linear (epsilon 1e4), and the unembedding reads only u (output 6 against 5). The variable is the sign along u at the last token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    tok = tiny_tokenizer()
    cfg = GPT2Config(n_layer=2, n_embd=D, n_head=4, n_positions=32, vocab_size=len(tok), bos_token_id=0,
                     eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
                     layer_norm_epsilon=1e4)  # a norm this loose is linear: x - mean(x), over 100
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(D, generator=g)
    u = u - u.mean()
    u = u / u.norm()
    with torch.no_grad():
        for block in model.transformer.h:
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                lin.weight.zero_()
                lin.bias.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.ln_f.bias.zero_()
        W = 0.3 * torch.randn(len(tok), D, generator=g)
        nuisance = torch.randn(D, 4, generator=g)  # 4 directions orthogonal to u (and to the constant vector)
        nuisance = nuisance - nuisance.mean(0, keepdim=True)
        nuisance = nuisance - u[:, None] * (u @ nuisance)[None, :]
        nuisance = torch.linalg.qr(nuisance).Q
        for value, ids in VALUE_TOKENS.items():
            for t in ids:
                n = nuisance @ torch.randn(4, generator=g)
                W[t] = (2.0 if value else -2.0) * u + n
        model.transformer.wte.weight.copy_(W)
        model.lm_head.weight.zero_()
        model.lm_head.weight[OUTPUTS[1]] = 50.0 * u
        model.lm_head.weight[OUTPUTS[0]] = -50.0 * u
    model.config._attn_implementation = "eager"
    return from_hf(model.eval(), tok, backend=backend, compat=compat, name="planted",
                   folder=tokenizer_dir()), u.double().numpy()


def planted_pairs(n: int = 128, seed: int = 0) -> Dataset:
    """Pairs of 4-token prompts (3 fillers, a value token): the expected output under the interchange is the
    source's value's output."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        vb, vs = int(rng.integers(2)), int(rng.integers(2))
        base = tuple(int(x) for x in rng.choice(FILLERS, 3)) + (int(rng.choice(VALUE_TOKENS[vb])),)
        source = tuple(int(x) for x in rng.choice(FILLERS, 3)) + (int(rng.choice(VALUE_TOKENS[vs])),)
        out.append(Example(prompt=base, counterfactual=source, answers=(OUTPUTS[vs],),
                           wrong_answers=(OUTPUTS[1 - vs],), label=vb,
                           meta={"variable": "value", "source_label": vs, "base_class": 0 if vb == vs else 1}))
    return Dataset("planted", tuple(out))


def test_das_recovers_the_planted_direction_and_the_placebo_does_not():
    model, u = planted()
    op = es.Interchange(activation="resid_post", layers=[0], positions=["END"], rank=1, epochs=30, lr=0.05,
                        das_batch_size=8, bases=["das", "pca", "random"], seed=0)
    result = op.run(model, planted_pairs(), quiet=True)
    basis = result.extra["bases"][0]["das"]
    cos = abs(float(basis[:, 0] @ u))  # the planted direction is a unit vector; so is the learned basis
    assert math.degrees(math.acos(min(1.0, cos))) < 10.0  # a random direction: about 83 degrees or more
    t = result.table.set_index("basis")
    assert t.loc["das", "n_changed"] >= 10
    assert t.loc["das", "iia_changed_ci_low"] > 0.8
    assert t.loc["das placebo", "iia_changed"] < 0.3  # moved as far, in a random direction: no flip
    assert t.loc["das", "iia_changed_ci_low"] > t.loc["das placebo", "iia_changed_ci_high"]
    assert t.loc["none", "iia_changed"] == 0.0  # no intervention never gives the source's value


def test_the_run_folder_holds_every_basis_and_the_split_and_the_saved_das_basis_gives_the_tables_iia(tmp_path):
    """bases.safetensors and split.json (a CLI user's only way to them), read with safetensors and json, not
    with entoscope: the held-out pairs' IIA recomputed by hand from the saved DAS basis on the planted model
    (every residual is the token's embedding there, and the output is the sign along u of
    h' = h + (h_src - h) B B^T at the last token) equals the table's, and the split is a partition of the pairs."""
    import json

    from safetensors import safe_open

    from entoscope.models.adapter import adapt

    model, u = planted()
    data = planted_pairs(64)
    result = es.Interchange(activation="resid_post", layers=[0], positions=["END"], rank=1, epochs=10, lr=0.05,
                            das_batch_size=8, bases=["das", "pca"], placebo=False, seed=0).run(model, data, quiet=True)
    result.save(tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert {"bases.safetensors", "split.json"} <= set(manifest["files"])
    with safe_open(str(tmp_path / "run" / "bases.safetensors"), "np") as f:
        keys = set(f.keys())
        das = f.get_tensor("resid_post.0@END/das")
        assert json.loads(f.metadata()["cells"]) == ["resid_post.0@END"]
    assert keys == {"resid_post.0@END/das", "resid_post.0@END/pca"} and das.shape == (D, 1) and das.dtype == np.float64
    split = json.loads((tmp_path / "run" / "split.json").read_text())
    held, train = split["held_out"], split["train"]
    assert sorted(held + train) == list(range(len(data))) and not set(held) & set(train)
    assert split["base_prompt"] == list(range(len(data))) and split["seed"] == 0
    W = adapt(model).weights.W_E.detach().double().numpy()
    hits = 0
    for k in held:  # pair k is record k of the user's pairs
        e = data[k]
        h, src = W[e.prompt[-1]], W[e.counterfactual[-1]]
        moved = h + (src - h) @ das @ das.T
        hits += int(np.sign(moved @ u) == (1 if e.meta["source_label"] else -1))
    t = result.table.set_index("basis")
    assert t.loc["das", "n_pairs"] == len(held)
    assert t.loc["das", "iia"] == pytest.approx(hits / len(held), abs=1e-12)


def test_interchange_algebra_by_hand():
    g = torch.Generator().manual_seed(0)
    h, src = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    basis = B.random_basis(7, 2, g)
    out = B.interchange(h, src, basis, 1.0)
    P = basis @ basis.T
    # inside span(B) the base's coordinates become the source's; outside they stay the base's
    torch.testing.assert_close(out @ P, src @ P)
    torch.testing.assert_close(out @ (torch.eye(7, dtype=torch.float64) - P), h @ (torch.eye(7, dtype=torch.float64) - P))
    half = B.interchange(h, src, basis, 0.5)
    torch.testing.assert_close(half, h + 0.5 * (src - h) @ P)
    # the placebo moves exactly as far, inside the random subspace
    q = B.random_basis(7, 2, g)
    moved = B.placebo(h, src, out - h, q[None].expand(5, 7, 2))
    torch.testing.assert_close((moved - h).norm(dim=-1), (out - h).norm(dim=-1))
    torch.testing.assert_close((moved - h) @ (q @ q.T), moved - h)


def test_principal_angles_against_known_subspaces():
    e = torch.eye(4, dtype=torch.float64)
    a = e[:, :2]
    b = torch.stack([e[:, 0], (e[:, 1] + e[:, 2]) / math.sqrt(2)], 1)
    cos = B.principal_cosines(a, b)  # angles 0 and 45 degrees
    torch.testing.assert_close(cos, torch.tensor([1.0, math.sqrt(0.5)], dtype=torch.float64))
    ov, angle = B.overlap(a, b)
    assert ov == pytest.approx((1 + 0.5) / 2) and angle == pytest.approx(0.0, abs=1e-6)


def test_fixed_bases_on_a_planted_mean_difference():
    g = torch.Generator().manual_seed(3)
    u = torch.zeros(6, dtype=torch.float64)
    u[2] = 1.0
    labels = torch.arange(2000) % 2  # classes overlapping (not separable), so the probe is near the LDA direction
    acts = torch.randn(2000, 6, generator=g, dtype=torch.float64) + 1.5 * labels[:, None] * u
    for make in (B.mean_difference_basis, B.probe_basis, B.neuron_basis):
        basis = make(acts, labels, 1)
        assert abs(float(basis[:, 0] @ u)) > 0.95, make.__name__


def test_unknown_basis_and_unlabelled_pairs_are_refused():
    model, _ = planted()
    with pytest.raises(es.EntoscopeError) as err:
        es.Interchange(bases=["das", "magic"]).plan(model, planted_pairs())
    assert err.value.code == "interchange_bases"
    unlabelled = Dataset("x", tuple(Example(prompt=e.prompt, counterfactual=e.counterfactual, answers=e.answers,
                                            wrong_answers=e.wrong_answers) for e in planted_pairs(8)))
    with pytest.raises(es.EntoscopeError) as err:
        es.Interchange(bases=["mean_difference"], positions=["END"]).plan(model, unlabelled)
    assert err.value.code == "interchange_labels"


def test_a_rank_above_the_sites_width_is_refused_before_any_forward(monkeypatch):
    """The demo's residual stream is 128 wide (its config's n_embd) and a head's z 32 (128 / 4 heads): a
    subspace has at most that many dimensions, so rank 129 (or 200) is refused by plan() and by run() before
    the model runs once, naming the width; rank 128 (the whole vector) is planned."""
    from entoscope.models.adapter import ModelAdapter

    model = es.load_model("demo")
    data = es.tasks.ioi(n=8, seed=0)
    es.Interchange(rank=128, layers=[0], bases=["das", "pca"]).plan(model, data)  # the whole vector: allowed
    runs = []
    monkeypatch.setattr(ModelAdapter, "run", lambda *a, **k: runs.append(1) or pytest.fail("a forward ran"))
    for rank in (129, 200):
        with pytest.raises(ConfigError) as err:
            es.Interchange(rank=rank, layers=[0], bases=["das", "pca"]).run(model, data, quiet=True)
        assert err.value.code == "interchange_rank" and "(128)" in str(err.value) and "1..128" in err.value.remedy
    with pytest.raises(ConfigError) as err:
        es.Interchange(activation="z", head=1, rank=33, layers=[0], bases=["random"]).plan(model, data)
    assert err.value.code == "interchange_rank" and "(32)" in str(err.value)
    es.Interchange(rank=200, layers=[0], bases=["boundless_das"]).plan(model, data)  # learns its own size
    assert not runs


def _demo_ioi_run(n: int = 24, **kw):
    op = es.Interchange(activation="resid_post", rank=8, epochs=10, lr=0.05, das_batch_size=16, seed=0, **kw)
    return op, op.run(es.load_model("demo"), es.tasks.ioi(n=n, seed=0), quiet=True)


def test_the_ioi_variable_is_located_on_the_demo_model():
    """Swapping the two names flips the answer; patching the whole vector shows where the names' roles are
    carried (S2 before the last layer, END at the last). DAS's subspace there beats its placebo, and where the
    whole vector does nothing (S2 at the last layer, END before it) no subspace does either."""
    # 64 prompts: the variable is which of 40 names, and DAS generalises to held-out names only with enough of them
    _, result = _demo_ioi_run(64, layers=[0, 2], positions=["S2", "END"], bases=["das", "pca", "random"])
    t = result.table.set_index(["site", "basis"])
    for site in ("resid_post.0@S2", "resid_post.2@END"):
        assert t.loc[(site, "full"), "iia"] == 1.0
        assert t.loc[(site, "das"), "iia_ci_low"] > t.loc[(site, "das placebo"), "iia_ci_high"]
        # docs/interchange.md says it: PCA of the training differences does better than DAS on held-out pairs here
        assert t.loc[(site, "pca"), "iia"] > t.loc[(site, "das"), "iia"]
    for site in ("resid_post.2@S2", "resid_post.0@END"):
        assert t.loc[(site, "full"), "iia"] == 0.0 and t.loc[(site, "das"), "iia"] == 0.0
    assert result.takeaway.startswith("Variable io: interchanging the whole vector")  # the clear result first
    assert "The das subspace (rank 8): the highest IIA" in result.takeaway
    assert "lies above the placebo's" in result.takeaway


def test_iia_matches_transformer_lens_fit_das_within_its_interval():
    """The same pairs, split, cell, rank, epochs, batch size, learning rate and seed, trained and measured by
    TransformerLens 4.3's own fit_das / intervened_logits: its IIA lies in our IIA's Wilson interval."""
    analysis = pytest.importorskip("transformer_lens.tools.analysis", reason="fit_das is TransformerLens 4.3's")
    if not hasattr(analysis, "fit_das"):
        pytest.skip("fit_das is TransformerLens 4.3's (this transformer-lens has no tools.analysis.fit_das)")
    from entoscope.data.tokenized import pad, tokenize_data
    from entoscope.interchange.causal import build_pairs, split
    from entoscope.models.adapter import adapt

    op, result = _demo_ioi_run(layers=[2], positions=["END"], bases=["das"], placebo=False)
    ours = result.table.set_index("basis").loc["das"]
    model = es.load_model("demo")
    adapter = adapt(model)
    pairs = build_pairs(es.tasks.ioi(n=24, seed=0), None)
    td = tokenize_data(adapter, pairs.prompts)
    held = split(pairs, op.test_share, op.seed)
    tokens, lengths = pad(td.prompts, 0)
    classes = torch.tensor([[adapter.token_id(c) for c in row] for row in pairs.classes])
    by_row = {tuple(tokens[i].tolist()): i for i in range(len(td.prompts))}

    def task_logits(batch):
        rows = [by_row[tuple(r.tolist())] for r in batch]
        logits = model(batch)
        at = logits[torch.arange(len(rows)), lengths[rows] - 1]
        return at.gather(1, classes[pairs.base[rows]].to(at.device))

    hook = adapter.hook_name("resid_post.2")
    train, test = np.flatnonzero(~held), np.flatnonzero(held)
    targets = torch.from_numpy(pairs.target)
    fit = analysis.fit_das(model, hook, tokens[pairs.base[train]], tokens[pairs.source[train]], targets[train],
                           task_logits, rank=8, base_positions=lengths[pairs.base[train]] - 1,
                           source_positions=lengths[pairs.source[train]] - 1, epochs=10, batch_size=16, lr=0.05,
                           seed=0)
    src = analysis.collect_activations(model, hook, tokens[pairs.source[test]], task_logits,
                                       positions=lengths[pairs.source[test]] - 1)
    logits = analysis.intervened_logits(model, hook, analysis.SubspaceInterchange(fit.subspace),
                                        tokens[pairs.base[test]], src, task_logits,
                                        positions=lengths[pairs.base[test]] - 1)
    theirs = float((logits.argmax(-1) == targets[test]).double().mean())
    assert ours["n_pairs"] == len(test)
    assert ours["iia_ci_low"] <= theirs <= ours["iia_ci_high"], (theirs, ours["iia"])


def test_pairs_read_back_from_their_saved_prompts():
    """A run's data is its pairs' prompts (the manifest's records, what a Ray worker prepares from): building pairs
    from them again gives the same pairs, not pairs of pairs."""
    from entoscope.interchange.causal import build_pairs

    for data in (es.tasks.ioi(n=6, seed=2), planted_pairs(8), es.tasks.greater_than(n=6, seed=1),
                 es.tasks.induction(n=6, seed=1)):
        first = build_pairs(data, None)
        again = build_pairs(first.prompts, None)
        assert (first.sets is None) == (again.sets is None) == (data.name != "greater_than")
        if first.sets is not None:  # greater_than's year sets travel with the prompts (a Ray worker's pairs)
            np.testing.assert_array_equal(again.sets, first.sets)
        assert len(again.prompts) == len(first.prompts) == 2 * len(data)
        for name in ("base", "source", "target", "base_value", "labels", "group"):
            np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
        assert again.classes == first.classes and again.variable == first.variable


def test_boundless_das_recovers_the_planted_direction_with_a_small_learned_size():
    """Boundless DAS (Wu et al. 2023) starts with half of the 64 rotated dimensions under its soft boundary; the
    boundary's cost shrinks it while the loss keeps the planted direction inside."""
    model, u = planted()
    op = es.Interchange(activation="resid_post", layers=[0], positions=["END"], epochs=30, lr=0.05,
                        das_batch_size=8, bases=["boundless_das"], placebo=False, seed=0)
    result = op.run(model, planted_pairs(), quiet=True)
    basis = torch.from_numpy(result.extra["bases"][0]["boundless_das"])
    assert 1 <= basis.shape[1] <= 4  # from 32: the size it learned is small
    eye = torch.eye(basis.shape[1], dtype=torch.float64)
    torch.testing.assert_close(basis.T @ basis, eye, atol=1e-5, rtol=0)  # orthonormal (float32 weights)
    ov, angle = B.overlap(basis, torch.from_numpy(u)[:, None])
    assert angle < 10.0  # u lies (nearly) inside the learned subspace; a random 4-dim one: about 75 degrees
    t = result.table.set_index("basis")
    assert t.loc["boundless_das", "rank"] == basis.shape[1]
    assert t.loc["boundless_das", "iia_changed_ci_low"] > 0.8


def test_sae_basis_is_the_span_of_the_chosen_decoder_directions():
    """A dictionary at resid_post.0 whose feature 3 decodes along the planted direction u: the sae basis of
    feature 3 is +-u and moves the variable; features 0 and 1 (random directions) do not."""
    from entoscope.models.dictionaries.catalog import register_dictionary
    from entoscope.models.dictionaries.dictionary import Dictionary

    model, u = planted()
    g = torch.Generator().manual_seed(5)
    W_dec = torch.randn(8, D, generator=g)
    W_dec[3] = 3.0 * torch.from_numpy(u).float()
    register_dictionary("planted_sae", Dictionary("standard", torch.randn(D, 8, generator=g), W_dec, torch.zeros(D),
                                                  "resid_post.0", "resid_post.0", b_enc=torch.zeros(8), space="any"),
                        replace=True)
    runs = {}
    for feats in ([3], [0, 1]):
        op = es.Interchange(activation="resid_post", layers=[0], positions=["END"], bases=["sae"], placebo=False,
                            dictionary="planted_sae", features=feats, seed=0)
        runs[tuple(feats)] = op.run(model, planted_pairs(64), quiet=True)
    basis = runs[(3,)].extra["bases"][0]["sae"]
    assert basis.shape == (D, 1) and abs(float(basis[:, 0] @ u)) == pytest.approx(1.0, abs=1e-6)
    pair = torch.from_numpy(runs[(0, 1)].extra["bases"][0]["sae"])
    P = pair @ pair.T  # the projection onto span(W_dec[0], W_dec[1]), against a hand least-squares fit
    X = W_dec[[0, 1]].double().T
    torch.testing.assert_close(P @ X, X)
    assert pair.shape == (D, 2)
    t3, t01 = (runs[k].table.set_index("basis").loc["sae"] for k in ((3,), (0, 1)))
    assert t3["iia_changed"] == 1.0 and t01["iia_changed_ci_high"] < t3["iia_changed_ci_low"]
    with pytest.raises(es.EntoscopeError) as err:
        es.Interchange(layers=[1], bases=["sae"], dictionary="planted_sae", features=[3]).plan(model, planted_pairs(8))
    assert err.value.code == "interchange_sae"
    register_dictionary("processed_sae", Dictionary("standard", torch.randn(D, 8, generator=g), W_dec, torch.zeros(D),
                                                    "resid_post.0", "resid_post.0", b_enc=torch.zeros(8),
                                                    space="processed"), replace=True)
    with pytest.raises(es.EntoscopeError) as err:  # trained on TransformerLens's processed stream; this is plain
        es.Interchange(layers=[0], bases=["sae"], dictionary="processed_sae", features=[3]).plan(model,
                                                                                                  planted_pairs(8))
    assert err.value.code == "dictionary_space_mismatch"


def test_the_takeaway_says_where_the_whole_vector_carries_the_variable_before_the_subspace():
    """The clear result first (docs/pages.md, 'leads follow what held'): the cells where interchanging the whole
    vector gives most pairs the prediction (the share >= 0.5 and its Wilson low end > 0.5, recomputed here
    from the table by the formula written out), then the learned subspace against its placebo."""
    from wilson_by_hand import wilson_by_hand

    model = es.load_model("demo")
    op = es.Interchange(layers=[0, 2], positions=["S2", "END"], bases=["pca"], rank=2, seed=0)
    result = op.run(model, {"task": "ioi", "n": 24, "seed": 1}, quiet=True)
    t, text = result.table, str(result.takeaway)
    full = t[t["basis"] == "full"]
    carries = [r["site"] for _, r in full.iterrows()
               if r["iia_changed"] >= 0.5 and wilson_by_hand(int(round(r["iia_changed"] * r["n_changed"])),
                                                             int(r["n_changed"]))[0] > 0.5]
    assert carries, "the demo's whole vector carries IOI's name somewhere (docs/interchange.md)"
    whole, subspace = text.index("interchanging the whole vector"), text.index("The pca subspace")
    assert whole < subspace
    named = text[whole:subspace]
    first = named.split("At the other cells")[0]
    assert result.takeaway.lead.startswith("Variable io: interchanging the whole vector")  # the lead: where it sits
    assert "The pca subspace" in result.takeaway.details
    assert all(site in first for site in carries)
    assert not any(site in first for site in set(full["site"]) - set(carries))
