"""The probing operation against code written separately here: one forward per prompt through
TransformerLens, fit_probes on activations collected by hand, a hand-written projection hook, and
numbers computed from their definitions; and a property of the demo model decodable above its control."""

import random

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.models import CachedModel, adapt, load_model
from entoscope.probing import CausalCheck, Probing, collect_activations, fit_probes, load_directions
from entoscope.probing.causal import ablation
from entoscope.probing.collect import collect, setup_collection
from entoscope.probing.pooling import Pooling
from entoscope.registry import lookup

from conftest import has_hooked_transformer

TINY_TEXTS = [
    "When Mary and John went to the store, John gave a drink to",
    "The capital of France is Paris. The capital of Spain is",
    "The war lasted from the year 1732 to the year",
    "When John and Mary went to the store, Mary gave",
    "one two three four five six seven eight nine ten one two three",
    "Mary and John",
    "The capital of Spain",
]


@pytest.fixture(scope="module")
def demo():
    return load_model("demo")


def _tiny_data(n=14, seed=0):
    """Prompts of many lengths, each naming ' Mary' or ' John' at least once (the marked token)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = rng.choice(TINY_TEXTS)
        if "Mary" not in text and "John" not in text:
            text = text + " Mary"
        who = " Mary" if "Mary" in text else " John"
        out.append(Example(text, answers=(" Mary",), wrong_answers=(" John",), label=i % 2,
                           meta={"who": who, "at": rng.randint(0, 2)}))
    return Dataset("tiny", tuple(out))


# ---------------------------------------------------------------------- poolings by hand
def test_poolings_on_a_hand_computed_batch():
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    x[0, 1] = torch.tensor([-5.0, 100.0, 2.0])
    x[0, 2:] = 1e6  # padding: must never be read
    lengths = torch.tensor([2, 4])
    pool = lambda name, at=None: lookup("pooling", name)(x, lengths, at)  # noqa: E731
    torch.testing.assert_close(pool("mean")[0], (x[0, 0] + x[0, 1]) / 2)
    torch.testing.assert_close(pool("mean")[1], x[1].mean(0))
    torch.testing.assert_close(pool("max")[0], torch.tensor([0.0, 100.0, 2.0]))
    torch.testing.assert_close(pool("max")[1], x[1, 3])
    torch.testing.assert_close(pool("first"), x[:, 0])
    torch.testing.assert_close(pool("last"), torch.stack([x[0, 1], x[1, 3]]))
    torch.testing.assert_close(pool("marked", torch.tensor([1, 2])), torch.stack([x[0, 1], x[1, 2]]))
    h = torch.randn(2, 3, 5)
    torch.testing.assert_close(lookup("head_pooling", "concat")(h), torch.cat([h[:, 0], h[:, 1], h[:, 2]], 1))
    torch.testing.assert_close(lookup("head_pooling", "mean")(h), (h[:, 0] + h[:, 1] + h[:, 2]) / 3)
    torch.testing.assert_close(lookup("head_pooling", "sum")(h), h[:, 0] + h[:, 1] + h[:, 2])


def test_marked_positions_found_by_token_string_and_index(tiny):
    data = _tiny_data()
    a = adapt(tiny)
    prompts = [a.tokenize(e.prompt) for e in data]
    vocab = a.vocab_strings()
    for occurrence in (0, -1):
        got = Pooling(type="marked", key="who", occurrence=occurrence).positions(prompts, [e.meta for e in data], vocab)
        for p, e, g in zip(prompts, data, got.tolist()):
            hits = [i for i, t in enumerate(p) if t == a.token_id(e.meta["who"])]
            assert g == hits[occurrence]
    got = Pooling(type="index", key="at").positions(prompts, [e.meta for e in data], vocab)
    assert got.tolist() == [e.meta["at"] for e in data]


# ---------------------------------------------------------------------- collection = one prompt at a time
POOLED = {"mean": lambda x, at: x[1:].mean(0),  # the prompts start with the prepended BOS: left out of the mean
          "mean_bos": lambda x, at: x.mean(0), "max": lambda x, at: x.max(0).values, "first": lambda x, at: x[0],
          "last": lambda x, at: x[-1], "marked": lambda x, at: x[at]}


def test_batched_collection_equals_one_forward_per_prompt(tiny):
    """Every pooling, over prompts of different lengths in padded batches of 4, against a
    TransformerLens run of each prompt alone (pooled here by hand; mean leaves the prepended BOS out, and
    counts it with bos_in_mean)."""
    data = _tiny_data()
    a = adapt(tiny)
    L, H = a.structure.n_layers, a.structure.n_heads
    assert len({len(a.tokenize(e.prompt)) for e in data}) > 3  # batches really are padded
    marked = Pooling(type="marked", key="who", occurrence=-1)
    at = marked.positions([a.tokenize(e.prompt) for e in data], [e.meta for e in data], a.vocab_strings()).tolist()
    caches = []
    for e in data:
        _, cache = tiny.run_with_cache(tiny.to_tokens(e.prompt, prepend_bos=True))
        caches.append(cache)
    for pooling, by_hand in POOLED.items():
        cfg = marked if pooling == "marked" else Pooling(type="mean", bos_in_mean=True) if pooling == "mean_bos" \
            else pooling
        resid = collect_activations(tiny, data, {"activation": "resid_post"}, cfg, batch_size=4)
        heads = collect_activations(tiny, data, {"activation": "z", "over": ["layer", "head"], "layers": [L - 1]},
                                    cfg, batch_size=4)
        concat = collect_activations(tiny, data, {"activation": "z", "layers": [0]}, cfg, "concat", batch_size=4)
        mean = collect_activations(tiny, data, {"activation": "z", "layers": [0]}, cfg, "mean", batch_size=4)
        for i, cache in enumerate(caches):
            for layer in range(L):
                ref = by_hand(cache[f"blocks.{layer}.hook_resid_post"][0], at[i])
                torch.testing.assert_close(resid.features(layer)[i], ref, rtol=1e-4, atol=1e-4)
            z_last = by_hand(cache[f"blocks.{L - 1}.attn.hook_z"][0], at[i])  # [H, d_head]
            for h in range(H):
                torch.testing.assert_close(heads.features(h)[i], z_last[h], rtol=1e-4, atol=1e-4)
            z0 = by_hand(cache["blocks.0.attn.hook_z"][0], at[i])
            torch.testing.assert_close(concat.features(0)[i], z0.reshape(-1), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mean.features(0)[i], z0.mean(0), rtol=1e-4, atol=1e-4)


def test_mean_pooling_leaves_a_leading_bos_out_only_where_position_0_is_the_bos(demo):
    """The rule of steering's read_at mean (docs/probing.md): position 0 left out where it holds the model's
    BOS token; prompts given as token ids that do not start with it keep every token. Checked against the
    demo's own forward (TransformerBridge.run_with_cache) averaged by hand; a prompt that is its BOS alone is
    refused, and bos_in_mean on another pooling too."""
    a = adapt(demo)
    bos = a.bos_token_id
    ids = a.tokenize(" the capital of France is", prepend_bos=False)
    assert bos is not None and ids[0] != bos
    data = Dataset("x", (Example("The capital of Spain is"), Example(tuple(ids))))
    got = collect_activations(demo, data, {"activation": "resid_post", "layers": [1]}, "mean", batch_size=2)
    _, cache = demo.run_with_cache(torch.tensor([a.tokenize("The capital of Spain is")]))
    x = cache["blocks.1.hook_resid_post"][0]
    torch.testing.assert_close(got.features(0)[0], x[1:].mean(0), rtol=1e-5, atol=1e-5)
    _, cache = demo.run_with_cache(torch.tensor([ids]))
    torch.testing.assert_close(got.features(0)[1], cache["blocks.1.hook_resid_post"][0].mean(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(es.EntoscopeError) as err:
        collect_activations(demo, Dataset("x", (Example(""),)), {"activation": "resid_post", "layers": [1]}, "mean")
    assert err.value.code == "pooling_mean_empty"
    with pytest.raises(es.EntoscopeError) as err:
        Pooling(type="last", bos_in_mean=True)
    assert err.value.code == "config_invalid" and "bos_in_mean is an option of pooling mean" in str(err.value)


def test_position_axis_reads_each_prompts_own_positions(tiny):
    data = _tiny_data()
    got = collect_activations(tiny, data, {"activation": "resid_pre", "over": ["layer", "position"],
                                           "layers": [1], "positions": [0, 2, -1, -3]}, batch_size=5)
    for i, e in enumerate(data):
        _, cache = tiny.run_with_cache(tiny.to_tokens(e.prompt, prepend_bos=True))
        x = cache["blocks.1.hook_resid_pre"][0]
        for u, pos in enumerate([0, 2, -1, -3]):
            torch.testing.assert_close(got.features(u)[i], x[pos], rtol=1e-4, atol=1e-4)


def test_collection_through_cached_model_is_served_and_equal(tmp_path):
    from conftest import get_tiny

    model = get_tiny("gpt2", "bridge", False)
    data = _tiny_data()
    plain = Probing(sites=es.Sites(activation="resid_post"), pooling="mean", batch_size=4).run(model, data, quiet=True)
    cm = CachedModel(model, cache_dir=tmp_path)
    op = Probing(sites=es.Sites(activation="resid_post"), pooling="mean", batch_size=4)
    first = op.run(cm, data, quiet=True)
    misses = cm.cache_stats()["misses"]
    second = op.run(cm, data, quiet=True)
    assert misses > 0 and cm.cache_stats()["hits"] == misses  # every batch of the second run read from disk
    for r in (first, second):
        np.testing.assert_allclose(r.table["test_accuracy"], plain.table["test_accuracy"])
        np.testing.assert_allclose(r.table["train_accuracy"], plain.table["train_accuracy"])


# ---------------------------------------------------------------------- the operation = fit_probes by hand
def test_operation_equals_fit_probes_on_hand_collected_activations(demo):
    data = es.tasks.ioi(n=72, seed=5)
    op = Probing(sites=es.Sites(activation="resid_pre"), C_grid=[0.01, 1.0], seed=3)
    result = op.run(demo, data, quiet=True)
    L = adapt(demo).structure.n_layers
    X = torch.zeros(L, len(data), adapt(demo).structure.d_model)
    for i, e in enumerate(data):
        _, cache = demo.run_with_cache(demo.to_tokens(e.prompt, prepend_bos=True))
        for layer in range(L):
            X[layer, i] = cache[f"blocks.{layer}.hook_resid_pre"][0, -1]
    ref = fit_probes(X, [e.label for e in data], C_grid=[0.01, 1.0], seed=3).to_frame()
    for col in ("test_accuracy", "test_auroc", "control_test_accuracy", "selectivity", "train_accuracy", "C"):
        np.testing.assert_allclose(result.table[col].to_numpy(dtype=float), ref[col].to_numpy(dtype=float),
                                   atol=1e-6, err_msg=col)
    pp = result.per_prompt  # the per-prompt predictions, aggregated independently, give the same accuracy
    by_site = pp.groupby("site", sort=False)["correct"].mean()
    np.testing.assert_allclose(by_site[result.table["site"]].to_numpy(), result.table["test_accuracy"].to_numpy())
    assert set(pp["example"]) == set(result.extra["fit"].splits[0].test.tolist())


def test_multiclass_labels_from_meta_and_regression_auto(demo):
    base = es.tasks.facts(n=320, seed=0)  # 10 prompts of each of 32 countries
    keep = tuple(e for e in base if e.meta["country"] in ("France", "Japan", "Peru"))
    data = Dataset("facts3", keep)
    result = Probing(sites=es.Sites(activation="resid_post", layers=[0]), pooling="mean", labels="meta.country",
                     C_grid=[0.1, 1.0]).run(demo, data, quiet=True)
    assert "3 classes" in " ".join(result.plan.notes)
    pp = result.per_prompt
    assert set(pp["prediction"]) <= {"France", "Japan", "Peru"}
    np.testing.assert_allclose(pp["correct"].mean(), result.table["test_accuracy"].iloc[0])
    gt = Probing(sites=es.Sites(activation="resid_post", layers=[0])).plan(demo, {"task": "greater_than", "n": 64})
    assert any("task: regression" in n for n in gt.notes)  # 0..99 start years: too many values for classes


# ---------------------------------------------------------------------- honesty of the numbers
def test_random_labels_are_at_chance_with_selectivity_near_zero(demo):
    rng = random.Random(1)
    base = es.tasks.ioi(n=400, seed=2)
    data = Dataset("coin", tuple(Example(e.prompt, meta={"coin": rng.random() < 0.5}) for e in base))
    result = Probing(sites=es.Sites(activation="resid_post"), labels="coin", split="kfold", k=5,
                     C_grid=[0.01, 1.0]).run(demo, data, quiet=True)
    t = result.table
    assert (abs(t["test_accuracy"] - 0.5) < 0.1).all(), t["test_accuracy"].tolist()
    assert (abs(t["selectivity"]) < 0.12).all(), t["selectivity"].tolist()


def test_demo_model_carries_the_start_year_to_the_last_token(demo):
    """greater-than: the start year's two digits are not in the last token's embedding but are
    decodable there after the first block, far above the shuffled-label control."""
    data = es.tasks.greater_than(n=200, seed=4)
    t = Probing(sites=es.Sites(activation="resid_pre")).run(demo, data, quiet=True).table
    assert t["test_r2"].iloc[0] < 0.2  # layer 0 = embeddings of the last token (the century)
    best = t["selectivity"].idxmax()
    assert t.loc[best, "test_r2"] > 0.7 and t.loc[best, "selectivity"] > 0.6
    assert t.loc[best, "control_test_r2"] < 0.1
    binary = Dataset("gt50", tuple(Example(e.prompt, label=int(e.label >= 50)) for e in data))
    tb = Probing(sites=es.Sites(activation="resid_pre"), split="kfold").run(demo, binary, quiet=True).table
    assert tb["test_accuracy"].iloc[0] < 0.65
    assert tb["test_accuracy"].max() > 0.85 and tb["selectivity"].max() > 0.3


# ---------------------------------------------------------------------- the causal check
@pytest.mark.parametrize("backend", ["bridge"] + (["hooked"] if has_hooked_transformer() else []))
def test_causal_check_equals_a_hand_written_projection_hook(backend):
    model = load_model("demo", backend=backend)
    data = es.tasks.ioi(n=40, seed=6)
    check = CausalCheck(sites=["resid_post.1"], metric="logit_diff", random_baseline=False)
    result = Probing(sites=es.Sites(activation="resid_post", layers=[1]), causal_check=check,
                     C_grid=[1.0]).run(model, data, quiet=True)
    fit = result.extra["fit"]
    u = fit.directions[0, 0].to(torch.float64)
    a = adapt(model)
    seen_after = []

    def project(x, hook):
        v = x[0, -1].to(torch.float64)
        x[0, -1] = (v - (v @ u) * u).to(x.dtype)
        seen_after.append(float(x[0, -1].to(torch.float64) @ u) / float(v.norm()))
        return x

    base, ablated = [], []
    for e in data:  # one prompt at a time, no padding
        tokens = model.to_tokens(e.prompt, prepend_bos=True)
        io, s = a.token_id(e.answers[0]), a.token_id(e.wrong_answers[0])
        with torch.no_grad():
            clean = model(tokens)[0, -1]
            hooked = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", project)])[0, -1]
        base.append(float(clean[io] - clean[s]))
        ablated.append(float(hooked[io] - hooked[s]))
    assert max(abs(p) for p in seen_after) < 1e-5
    pp = result.extra["causal_per_prompt"]
    np.testing.assert_allclose(pp["metric_base"], base, atol=2e-4)
    np.testing.assert_allclose(pp["metric_ablated"], ablated, atol=2e-4)
    row = result.table.iloc[0]
    np.testing.assert_allclose(row["metric_change"], np.mean(np.array(ablated) - np.array(base)), atol=1e-4)
    # the probe's own direction is gone: its output on the re-collected activations is its
    # intercept, so it answers one class for every test row
    y = np.array([e.label for e in data])
    test = fit.splits[0].test.numpy()
    constant_class = int(fit.raw_intercept[0, 0, 0] > 0)
    np.testing.assert_allclose(row["probe_accuracy_ablated"], np.mean(y[test] == constant_class))


def test_k_fold_causal_check_scores_each_fold_after_removing_its_own_direction(demo):
    """With k folds each fold's probe has its own direction; removing it makes that probe constant, so
    its held-out accuracy is the share of its test rows in the class its intercept picks."""
    data = es.tasks.ioi(n=60, seed=2)
    check = CausalCheck(sites=["resid_post.1"], metric="logit_diff", random_baseline=False)
    result = Probing(sites=es.Sites(activation="resid_post", layers=[1]), causal_check=check, split="kfold", k=4,
                     C_grid=[0.01]).run(demo, data, quiet=True)
    fit = result.extra["fit"]
    y = np.array([e.label for e in data])
    expected = [np.mean(y[sp.test.numpy()] == int(fit.raw_intercept[f, 0, 0] > 0)) for f, sp in enumerate(fit.splits)]
    assert len(expected) == 4 and fit.direction_agreement[0] < 1 - 1e-6  # the folds' directions do differ
    np.testing.assert_allclose(result.table.iloc[0]["probe_accuracy_ablated"], np.mean(expected), atol=1e-9)


def test_each_folds_own_ablation_in_one_pass_equals_one_collection_per_fold():
    """k-fold test rows are disjoint, so one collection ablates each prompt by the fold that tests it: its rows
    equal those of fold f's own collection (the per-fold way), and the plan counts one pass, not k."""
    from conftest import get_tiny

    from entoscope.data.tokenized import make_batches, pad_id
    from entoscope.probing.causal import fold_ablation, fold_testing_each

    model = adapt(get_tiny("llama", "bridge", False))
    data = _tiny_data()
    cs = setup_collection(model, data, es.Sites(activation="resid_post", layers=[1]), "last", "concat")
    unit, n = cs.units[0], len(cs.td)
    g = torch.Generator().manual_seed(1)
    dirs = torch.randn(3, 1, unit.size, generator=g, dtype=torch.float64)  # three folds' directions
    tests = [torch.arange(f, n, 3) for f in range(3)]
    fold_of = fold_testing_each(tests, n)
    assert fold_of is not None and fold_testing_each([tests[0], tests[0][:1]], n) is None  # overlap: per fold
    batches = make_batches(cs.td, 3, pad_id(model))
    one = collect(model, batches, [unit], cs.pool, cs.at, cs.head_pooling, n,
                  interventions=fold_ablation(unit.members[0], dirs, fold_of, cs.pool, cs.at, cs.head_pooling))
    for f, rows in enumerate(tests):
        own = collect(model, batches, [unit], cs.pool, cs.at, cs.head_pooling, n,
                      interventions=ablation(unit.members[0], dirs[f], cs.pool, cs.at, cs.head_pooling))
        torch.testing.assert_close(one.features(0)[rows], own.features(0)[rows], rtol=1e-6, atol=1e-6)
    data_ioi = es.tasks.ioi(n=40, seed=3)
    check = CausalCheck(sites=["resid_post.1"], metric="logit_diff", random_baseline=True)
    plan = Probing(sites=es.Sites(activation="resid_post", layers=[1]), causal_check=check, split="kfold", k=5,
                   C_grid=[0.01]).plan(es.load_model("demo"), data_ioi)
    assert plan.forward_passes == 40 * (1 + 1 * (1 + 1 + 1))  # collection; ablated, random, every fold's own


@pytest.mark.parametrize("head_pooling", ["concat", "mean", None])
def test_ablation_leaves_no_projection_where_the_probe_reads(head_pooling):
    from conftest import get_tiny

    model = adapt(get_tiny("llama", "bridge", False))
    data = _tiny_data()
    over = ["layer", "head"] if head_pooling is None else ["layer"]
    for pooling in ("last", "mean"):
        cs = setup_collection(model, data, es.Sites(activation="z", over=over, layers=[1]), pooling,
                              head_pooling or "concat")
        unit = cs.units[0]
        g = torch.Generator().manual_seed(0)
        d = torch.randn(2, unit.size, generator=g, dtype=torch.float64)  # a rank-2 span, as a 2-class probe
        from entoscope.data.tokenized import make_batches, pad_id

        batches = make_batches(cs.td, 4, pad_id(model))
        before = collect(model, batches, [unit], cs.pool, cs.at, cs.head_pooling, len(cs.td))
        after = collect(model, batches, [unit], cs.pool, cs.at, cs.head_pooling, len(cs.td),
                        interventions=ablation(unit.members[0], d, cs.pool, cs.at, cs.head_pooling))
        Q, _ = torch.linalg.qr(d.T)
        x0, x1 = before.features(0).double(), after.features(0).double()
        assert (x1 @ Q).abs().max() < 1e-4 * x0.norm(dim=1).max()
        # the part orthogonal to the span is unchanged
        torch.testing.assert_close(x1 - (x1 @ Q) @ Q.T, x0 - (x0 @ Q) @ Q.T, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- refusals before any run, saving, YAML
def _code(fn):
    with pytest.raises(es.EntoscopeError) as err:
        fn()
    return err.value.code


def test_refusals_come_from_plan_before_any_run(demo):
    ioi = {"task": "ioi", "n": 24}
    resid = es.Sites(activation="resid_post")
    assert _code(lambda: Probing().plan(demo, {"task": "induction", "n": 8})) == "data_no_labels"
    assert _code(lambda: Probing(labels="nope").plan(demo, ioi)) == "data_field_missing"
    assert _code(lambda: Probing(sites=es.Sites(activation="resid_post", over=["layer", "position"]),
                                 pooling="mean").plan(demo, ioi)) == "pooling_and_position_axis"
    assert _code(lambda: Probing(pooling="marked").plan(demo, ioi)) == "pooling_needs_key"
    absent = Dataset("x", tuple(Example(e.prompt, label=e.label, meta={"who": "Zyzzyva"}) for e in es.tasks.ioi(n=8)))
    assert _code(lambda: Probing(pooling={"type": "marked", "key": "who"}).plan(demo, absent)) \
        == "pooling_position_missing"
    assert _code(lambda: Probing(pooling="median").plan(demo, ioi)) == "unknown_pooling"
    assert _code(lambda: Probing(head_pooling="median", sites=es.Sites(activation="z")).plan(demo, ioi)) \
        == "unknown_head_pooling"
    assert _code(lambda: Probing(sites=es.Sites(activation="pattern")).plan(demo, ioi)) == "probe_site_kind"
    assert _code(lambda: Probing(control="groups").plan(demo, ioi)) == "config_invalid"
    no_answers = Dataset("x", tuple(Example(e.prompt, label=e.label) for e in es.tasks.ioi(n=24)))
    assert _code(lambda: Probing(causal_check={}).plan(demo, no_answers)) == "data_no_answers"
    assert _code(lambda: Probing(sites=es.Sites(activation="resid_post", over=[]), causal_check={"sites": "all"})
                 .plan(demo, ioi)) == "causal_check_site"
    assert _code(lambda: Probing(sites=resid, causal_check={"sites": ["L7"]}).plan(demo, ioi)) == "causal_check_site"
    assert _code(lambda: Probing(sites=resid, causal_check={"metric": "kl"}).plan(demo, ioi)) \
        == "metric_needs_reference"
    assert _code(lambda: Probing(split="kfold", k=20).plan(demo, {"task": "ioi", "n": 16})) == "config_invalid"
    rare = Dataset("rare", tuple(Example(e.prompt, label=int(i == 0)) for i, e in enumerate(es.tasks.ioi(n=12))))
    assert _code(lambda: Probing(split="kfold", k=3).plan(demo, rare)) == "data_invalid"  # class 1: one prompt


def test_saved_directions_reload_and_the_yaml_example_plans(demo, tmp_path):
    from pathlib import Path

    from entoscope.config import build_operation, load_experiments

    result = Probing(sites=es.Sites(activation="resid_post"), C_grid=[1.0]).run(demo, {"task": "ioi", "n": 40},
                                                                                quiet=True)
    out = result.save(tmp_path / "run")
    for name in ("table.csv", "per_prompt.csv", "index.html", "manifest.json", "directions.safetensors",
                 "directions.json"):
        assert (out / name).exists(), name
    loaded = load_directions(out / "directions.safetensors")
    torch.testing.assert_close(loaded.directions, result.extra["fit"].directions.cpu())
    assert loaded.site_names == list(result.table["site"])
    example = Path(__file__).resolve().parent.parent / "examples" / "probing.yaml"
    entries = load_experiments(example)
    assert entries
    for name, entry in entries.items():
        op, data = build_operation(entry)
        assert isinstance(op, Probing)
        op.plan(demo, data if data is not None else None)
