"""Steering against independent code: hand-written TransformerLens hooks (run_with_hooks adding the same vector,
one prompt at a time) give the operation's per-prompt metric, KL and loss; projecting a residual direction out
everywhere equals orthogonalising every weight that writes the residual stream (Arditi et al. 2024); a mean
difference equals numpy's on run_with_cache activations; coefficient 0 is the unsteered run exactly; set,
project_out and the position rules equal the formulas written out in a hook; the direction's sources (probe,
feature, file) equal the objects they come from; saving and loading a run keeps its direction."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.models.adapter import adapt
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_tokenizer, tokenizer_dir

TOL = 1e-4


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _vector(width, seed=0, norm=20.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(width, generator=g)
    return v / v.norm() * norm


def _hand(model, tokens, hooks):
    """Logits of one prompt under hand-written TransformerLens hooks."""
    with torch.no_grad():
        return model.run_with_hooks(torch.tensor([tokens]), fwd_hooks=hooks)[0].double()


def _kl_mean(steered, clean):
    ls, lu = steered.log_softmax(-1), clean.log_softmax(-1)
    return float((ls.exp() * (ls - lu)).sum(-1).mean())


def _loss(logits, tokens):
    logp = logits.log_softmax(-1)
    return float(-logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].mean())


def _compare_with_hooks(model, data, hook_name, v, coefficients, *, edit=None):
    """Run Steering, then every task prompt alone with a run_with_hooks hook; per-prompt metric, KL, loss agree."""
    a = adapt(model)
    site = str(a.resolve(hook_name))
    d = es.Direction(site, v)
    op = es.Steering(direction=d, coefficients=coefficients, side_effects=None, stats={"n_boot": 50})
    r = op.run(model, data, quiet=True)
    pp = r.per_prompt
    pp = pp[(pp.set == "task") & (pp.direction == "direction")]
    hook = a.hook_name(site)
    for i, e in enumerate(data):
        tokens = a.tokenize(e.prompt)
        ans, wrong = a.token_id(e.answers[0]), a.token_id(e.wrong_answers[0])
        clean = _hand(model, tokens, [])
        for c in coefficients:
            fn = edit(c) if edit else (lambda x, hook, c=c: x + c * v.to(x.dtype))
            steered = _hand(model, tokens, [(hook, fn)])
            row = pp[(pp.example == i) & (pp.coefficient == c)].iloc[0]
            assert row.metric == pytest.approx(float(steered[-1, ans] - steered[-1, wrong]), abs=TOL)
            assert row.metric_unsteered == pytest.approx(float(clean[-1, ans] - clean[-1, wrong]), abs=TOL)
            assert row.kl == pytest.approx(_kl_mean(steered, clean), abs=TOL)
            assert row.loss_change == pytest.approx(_loss(steered, tokens) - _loss(clean, tokens), abs=TOL)
    return r


@pytest.mark.parametrize("logit_values", [1 << 23, 1])
def test_a_hand_written_hook_on_the_bridge_gives_the_per_prompt_metric_kl_and_loss(demo, monkeypatch, logit_values):
    """logit_values 1: the loss and KL are made one steered row at a time (runs.LOGIT_VALUES), as on a model
    with a large vocabulary; the numbers are the hand-written hooks' either way."""
    import entoscope.steering.runs as runs

    monkeypatch.setattr(runs, "LOGIT_VALUES", logit_values)
    data = es.tasks.ioi(n=5, seed=3)
    r = _compare_with_hooks(demo, data, "resid_pre.1", _vector(128), [-1.0, 0.5, 2.0])
    assert r.table["effect"].abs().max() > 0.05  # the hook really changed something


def test_held_out_side_effects_equal_hand_written_hooks(demo):
    v = _vector(128, seed=4)
    op = es.Steering(direction=es.Direction("resid_post.0", v), coefficients=[1.5], metric="logit_diff",
                     side_effects={"tasks": ["facts"], "n": 4, "seed": 5, "text": {"prompts": ["one two three four"]}},
                     stats={"n_boot": 50})
    r = op.run(demo, es.tasks.ioi(n=3, seed=1), quiet=True)
    a = adapt(demo)
    pp = r.per_prompt
    facts = es.tasks.facts(n=4, seed=5, tokenizer=a.tokenizer)
    kls, losses, top1 = [], [], []
    for e in [es.Example("one two three four")] + list(facts):  # the held-out text comes first (rows.py)
        tokens = a.tokenize(e.prompt)
        clean = _hand(demo, tokens, [])
        steered = _hand(demo, tokens, [("blocks.0.hook_resid_post", lambda x, hook: x + 1.5 * v)])
        kls.append(_kl_mean(steered, clean))
        losses.append(_loss(steered, tokens) - _loss(clean, tokens))
        if e.answers:
            ans = a.token_id(e.answers[0])
            top1.append(float(steered[-1].argmax() == ans) - float(clean[-1].argmax() == ans))
    held = pp[(pp.set != "task") & (pp.direction == "direction")]
    np.testing.assert_allclose(held.kl.to_numpy(), kls, atol=TOL)
    np.testing.assert_allclose(held.loss_change.to_numpy(), losses, atol=TOL)
    row = r.table[r.table.direction == "direction"].iloc[0]
    assert row.kl == pytest.approx(np.mean(kls), abs=TOL)
    assert row.loss_change == pytest.approx(np.mean(losses), abs=TOL)
    assert row.facts_change == pytest.approx(np.mean(top1), abs=1e-12)
    assert row.n_held_out == 5


def test_coefficient_zero_is_the_unsteered_run_exactly(demo):
    data = es.tasks.ioi(n=6, seed=2)
    for mode in ("add", "project_out"):
        r = es.Steering(direction=es.Direction("resid_pre.2", _vector(128, 1)), mode=mode, coefficients=[0.0, 1.0],
                        side_effects={"tasks": ["ioi"], "n": 4}, stats={"n_boot": 50}).run(demo, data, quiet=True)
        pp = r.per_prompt
        zero = pp[pp.coefficient == 0.0]
        assert (zero.metric.to_numpy() == zero.metric_unsteered.to_numpy()).all()
        assert (zero.kl.to_numpy() == 0).all() and (zero.loss_change.to_numpy() == 0).all()
        assert (r.table[r.table.coefficient == 0.0][["effect", "kl", "loss_change"]].to_numpy() == 0).all()
        one = pp[(pp.coefficient == 1.0) & (pp.direction == "direction")]
        assert (one.metric != one.metric_unsteered).all()
    a = adapt(demo)  # and the unsteered run is the model's own (a plain forward of each prompt)
    for i, e in enumerate(data):
        logits = _hand(demo, a.tokenize(e.prompt), [])
        want = float(logits[-1, a.token_id(e.answers[0])] - logits[-1, a.token_id(e.wrong_answers[0])])
        assert zero[(zero.example == i) & (zero.set == "task")].metric.iloc[0] == pytest.approx(want, abs=TOL)


def test_set_and_project_out_equal_their_formulas_in_a_hook(demo):
    v = _vector(128, seed=7, norm=12.0)
    u = v / v.norm()
    data = es.tasks.ioi(n=3, seed=8)
    for mode, fn in (("set", lambda c: lambda x, hook: x + (c * v.norm() - (x @ u)[..., None]) * u),
                     ("project_out", lambda c: lambda x, hook: x - c * (x @ u)[..., None] * u)):
        r = _compare_with_hooks_mode(demo, data, v, mode, fn)
        assert r.table["effect"].abs().max() > 1e-3


def _compare_with_hooks_mode(model, data, v, mode, fn):
    a = adapt(model)
    coefficients = [0.5, 1.0]
    r = es.Steering(direction=es.Direction("resid_pre.1", v), mode=mode, coefficients=coefficients,
                    side_effects=None, stats={"n_boot": 50}).run(model, data, quiet=True)
    pp = r.per_prompt
    for i, e in enumerate(data):
        tokens = a.tokenize(e.prompt)
        ans, wrong = a.token_id(e.answers[0]), a.token_id(e.wrong_answers[0])
        for c in coefficients:
            steered = _hand(model, tokens, [("blocks.1.hook_resid_pre", fn(c))])
            got = pp[(pp.example == i) & (pp.coefficient == c) & (pp.direction == "direction")].metric.iloc[0]
            assert got == pytest.approx(float(steered[-1, ans] - steered[-1, wrong]), abs=TOL)
    return r


def test_positions_last_and_by_role_steer_only_those_tokens(demo):
    a = adapt(demo)
    v = _vector(128, seed=9, norm=30.0)
    data = es.tasks.ioi(n=4, seed=4)
    td_roles = {}
    for positions in ("last:2", ["S2", -1]):
        r = es.Steering(direction=es.Direction("resid_pre.1", v), coefficients=[1.0], positions=positions,
                        side_effects=None, stats={"n_boot": 50}).run(demo, data, quiet=True)
        pp = r.per_prompt
        for i, e in enumerate(data):
            tokens = a.tokenize(e.prompt)
            T = len(tokens)
            if positions == "last:2":
                where = [T - 2, T - 1]
            else:
                from entoscope.data.tokenized import tokenize_data

                td_roles.setdefault("td", tokenize_data(a, data))
                td = td_roles["td"]
                where = [int(td.roles.positions[i, td.roles.index("S2")]), T - 1]

            def fn(x, hook, where=where):
                x = x.clone()
                x[:, where] += v
                return x
            steered = _hand(demo, tokens, [("blocks.1.hook_resid_pre", fn)])
            want = float(steered[-1, a.token_id(e.answers[0])] - steered[-1, a.token_id(e.wrong_answers[0])])
            got = pp[(pp.example == i) & (pp.direction == "direction")].metric.iloc[0]
            assert got == pytest.approx(want, abs=TOL)


def test_a_mean_difference_equals_numpys_on_run_with_cache_activations(demo):
    data = es.tasks.greater_than(n=12, seed=3)
    a = adapt(demo)
    d = es.Direction.mean_difference(demo, "resid_pre.2", data, batch_size=5)
    acts = []
    for e in data:
        for prompt in (e.prompt, e.counterfactual):
            _, cache = demo.run_with_cache(torch.tensor([a.tokenize(prompt)]))
            acts.append(cache["blocks.2.hook_resid_pre"][0, -1].double().numpy())
    acts = np.array(acts)
    want = acts[0::2].mean(0) - acts[1::2].mean(0)
    np.testing.assert_allclose(d.vector.double().numpy(), want, atol=1e-5, rtol=1e-5)
    assert d.provenance["source"] == "mean_difference" and d.provenance["n_positive"] == 12
    # two prompt sets, read as the mean over the prompt's tokens: the BOS left out (default), or counted
    pos, neg = es.tasks.ioi(n=5, seed=1), es.tasks.facts(n=4, seed=1)
    for bos_in_mean, first in ((False, 1), (True, 0)):
        d2 = es.Direction.mean_difference(demo, "mlp_out.0", pos, neg, read_at="mean", bos_in_mean=bos_in_mean)
        mean_of = []
        for ds in (pos, neg):
            rows = []
            for e in ds:
                tokens = a.tokenize(e.prompt)
                assert tokens[0] == a.bos_token_id
                _, cache = demo.run_with_cache(torch.tensor([tokens]))
                rows.append(cache["blocks.0.hook_mlp_out"][0, first:].double().mean(0).numpy())
            mean_of.append(np.mean(rows, 0))
        np.testing.assert_allclose(d2.vector.double().numpy(), mean_of[0] - mean_of[1], atol=1e-5, rtol=1e-5)
        assert d2.provenance["bos_in_mean"] is bos_in_mean
    # the top principal component of the paired differences (numpy's SVD), scaled by the mean's component
    d3 = es.Direction.mean_difference(demo, "resid_pre.2", data, pca=True)
    diffs = acts[0::2] - acts[1::2]
    _, _, vt = np.linalg.svd(diffs - diffs.mean(0))
    u = vt[0] * np.sign(vt[0] @ diffs.mean(0))
    np.testing.assert_allclose(d3.vector.double().numpy(), (diffs.mean(0) @ u) * u, atol=1e-4, rtol=1e-4)


def test_the_run_made_direction_equals_the_python_one_and_is_saved_with_the_run(demo, tmp_path):
    spec = {"source": "mean_difference", "site": "resid_pre.2", "data": {"task": "greater_than", "n": 10, "seed": 100}}
    r = es.Steering(direction=spec, coefficients=[-0.25, 0.25], metric="prob_diff",
                    side_effects={"tasks": ["greater_than"], "n": 6}, stats={"n_boot": 50}).run(
        demo, {"task": "greater_than", "n": 6, "seed": 7}, quiet=True)
    d = es.Direction.mean_difference(demo, "resid_pre.2", {"task": "greater_than", "n": 10, "seed": 100})
    np.testing.assert_allclose(r.extra["direction"].vector.numpy(), d.vector.numpy(), atol=1e-5)
    folder = r.save(tmp_path / "run")
    loaded = es.Direction.load(folder)
    assert torch.equal(loaded.vector, r.extra["direction"].vector) and loaded.site == "resid_pre.2"
    random = es.Direction.load(folder, which="random")
    assert random.norm == pytest.approx(loaded.norm, rel=1e-6) and abs(float(random.unit @ loaded.unit)) < 0.5
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["direction"]["provenance"]["source"] == "mean_difference"
    assert manifest["direction"]["provenance"]["n_positive"] == 10
    sets = {e["meta"]["steering_set"] for e in manifest["data"]["records"]}
    assert sets == {"task", "score:greater_than", "direction="}
    # a Direction made in Python travels in the config: the manifest's config rebuilds the same run
    r2 = es.Steering(direction=loaded, coefficients=[0.25], side_effects=None, metric="prob_diff",
                     stats={"n_boot": 50}).run(demo, {"task": "greater_than", "n": 4, "seed": 7}, quiet=True)
    again = es.Steering(**r2.manifest["config"]).run(demo, es.Dataset.from_records(
        "greater_than", r2.manifest["data"]["records"]), quiet=True)
    assert again.table["effect"].tolist() == r2.table["effect"].tolist()


def test_directions_from_a_probe_a_feature_and_files_are_those_objects(demo, tmp_path):
    probe = es.Probing(sites=es.Sites(activation="resid_post", over=["layer"]), stats={"n_boot": 50}).run(
        demo, es.tasks.ioi(n=40, seed=3), quiet=True)
    d = es.Direction.from_probe(probe, "resid_post.1")
    fit = probe.extra["fit"]
    assert d.site == "resid_post.1" and torch.equal(d.vector, fit.directions[1, 0].float())
    assert d.provenance["points_to"] == str(fit.classes[1])
    from entoscope.models.dictionaries.catalog import get_dictionary

    f = es.Direction.from_feature("demo/resid_post.1", 5, model=demo)
    assert f.site == "resid_post.1" and torch.equal(f.vector, get_dictionary("demo/resid_post.1").W_dec[5].float())
    v = np.arange(128, dtype=np.float32) - 60.5
    np.save(tmp_path / "v.npy", v)
    assert torch.equal(es.Direction.from_file(tmp_path / "v.npy", "resid_pre.1").vector, torch.from_numpy(v))
    from safetensors.numpy import save_file

    save_file({"a": np.stack([v, -v])}, str(tmp_path / "v.safetensors"))
    got = es.Direction.from_file(tmp_path / "v.safetensors", "resid_pre.1", row=1)
    assert torch.equal(got.vector, torch.from_numpy(-v))
    # the config spellings read the same vectors
    probe.save(tmp_path / "probe")
    spec = es.steering.DirectionSpec(source="probe", path=str(tmp_path / "probe" / "directions.safetensors"),
                                     probe_site="resid_post.1", site="resid_post.1")
    assert torch.allclose(spec.resolve(adapt(demo)).vector, d.vector)
    spec = es.steering.DirectionSpec(source="feature", dictionary="demo/resid_post.1", feature=5)
    assert torch.equal(spec.resolve(adapt(demo)).vector, f.vector)


def _orthogonalised(hf, u):
    """A copy of a GPT-2 HuggingFace model whose every write into the residual stream (token and position
    embeddings, attention and MLP output projections and their biases) has u removed (Arditi et al. 2024);
    the unembedding is untied first so that it stays the model's."""
    m = copy.deepcopy(hf)
    P = torch.eye(len(u)) - torch.outer(u, u)
    with torch.no_grad():
        m.lm_head.weight = torch.nn.Parameter(hf.transformer.wte.weight.detach().clone())
        m.transformer.wte.weight = torch.nn.Parameter(hf.transformer.wte.weight.detach() @ P)
        m.transformer.wpe.weight.copy_(m.transformer.wpe.weight @ P)
        for block in m.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):  # Conv1D: y = x W + b, W [in, out]
                proj.weight.copy_(proj.weight @ P)
                proj.bias.copy_(proj.bias @ P)
    m.config.tie_word_embeddings = False
    return m


def test_projecting_a_direction_out_everywhere_equals_orthogonalised_weights():
    hf = tiny_hf_model("gpt2")
    model = from_hf(hf, tiny_tokenizer(), name="tiny-gpt2", folder=tokenizer_dir())
    a = adapt(model)
    u = _vector(a.structure.d_model, seed=11, norm=1.0)
    ortho = from_hf(_orthogonalised(hf, u), tiny_tokenizer(), name="tiny-gpt2-ortho", folder=tokenizer_dir())
    prompts = [list(range(1, 9)), [0, 40, 41, 42, 43, 44], [0, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    data = es.Dataset("ids", tuple(es.Example(tuple(p), answers=(3,), wrong_answers=(4,)) for p in prompts))
    r = es.Steering(direction=es.Direction("resid_pre.0", u), at="residual", mode="project_out", coefficients=[1.0],
                    side_effects=None, stats={"n_boot": 50}).run(model, data, quiet=True)
    pp = r.per_prompt
    got = pp[pp.direction == "direction"].sort_values("example").metric.to_numpy()
    with torch.no_grad():
        want = [float((lo := ortho(torch.tensor([p]))[0, -1])[3] - lo[4]) for p in prompts]
        plain = [float((lo := model(torch.tensor([p]))[0, -1])[3] - lo[4]) for p in prompts]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(np.array(want) - np.array(plain)).max() > 1e-3  # removing it changed the model
    assert r.manifest["direction"]["written_at"] == ["resid_pre.0", "resid_mid.0", "resid_pre.1", "resid_mid.1",
                                                     "resid_post.1"]


def test_a_mean_read_leaves_the_bos_out_unless_asked_in_python_and_in_a_run(demo):
    """Issue 37: read_at mean counted the BOS although the docs said "the prompt's tokens". Two prompt sets of
    different lengths (where the BOS does not cancel), the run-made direction and the Python one against the
    mean over tokens 1.. (or 0.. with bos_in_mean) of run_with_cache activations."""
    a = adapt(demo)
    pos, neg = ({"task": "ioi", "n": 4, "seed": 2}, {"task": "facts", "n": 3, "seed": 2})
    data = {k: es.load_data(v) for k, v in (("pos", pos), ("neg", neg))}
    assert {len(a.tokenize(e.prompt)) for e in data["pos"]} != {len(a.tokenize(e.prompt)) for e in data["neg"]}
    for bos_in_mean, first in ((False, 1), (True, 0)):
        means = []
        for ds in (data["pos"], data["neg"]):
            rows = []
            for e in ds:
                _, cache = demo.run_with_cache(torch.tensor([a.tokenize(e.prompt)]))
                rows.append(cache["blocks.1.hook_resid_post"][0, first:].double().mean(0).numpy())
            means.append(np.mean(rows, 0))
        want = means[0] - means[1]
        spec = {"source": "mean_difference", "site": "resid_post.1", "data": pos, "negative": neg, "read_at": "mean",
                "bos_in_mean": bos_in_mean}
        r = es.Steering(direction=spec, coefficients=[0.25], side_effects=None, metric="prob_diff",
                        stats={"n_boot": 0}).run(demo, {"task": "greater_than", "n": 2, "seed": 7}, quiet=True)
        np.testing.assert_allclose(r.extra["direction"].vector.double().numpy(), want, atol=1e-5, rtol=1e-5)
        d = es.Direction.mean_difference(demo, "resid_post.1", pos, neg, read_at="mean", bos_in_mean=bos_in_mean)
        np.testing.assert_allclose(d.vector.double().numpy(), want, atol=1e-5, rtol=1e-5)
