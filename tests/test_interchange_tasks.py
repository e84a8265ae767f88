"""The greater_than and induction tasks' high-level causal models (causal.py): their pairs and labels checked
against what the prompts say (the years and words read back from the text), and, on the demo model, the
whole-vector interchange's IIA against plain forwards: at the last layer's last token it hands the base the
source run's logits (so IIA is the share of held-out pairs whose source run alone gives the prediction), and
at layer 0 at the copied token (induction's B1) it is a hook written here that puts the source's vector in."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.interchange.causal import build_pairs, split


def _start(prompt: str) -> int:
    return int(re.search(r"the year \d\d(\d\d)\b", prompt).group(1))  # the first year written is the start year


def test_greater_than_pairs_by_hand():
    data = es.tasks.greater_than(n=8, seed=0)
    yy, decade = build_pairs(data, "yy"), build_pairs(data, "decade")
    # pair 0, read off the prompts: base 1508, source 1586 (yy: years > 86 follow); decade: source 1577, so the
    # base's 08 with the source's decade 7: 78, the years 79..99 follow
    assert "1508" in yy.prompts[0].prompt and "1586" in yy.prompts[int(yy.source[0])].prompt
    assert [c for c, s in zip(yy.classes[0], yy.sets[0]) if s == 0] == [str(y) for y in range(87, 100)]
    assert "1577" in decade.prompts[int(decade.source[0])].prompt
    assert [c for c, s in zip(decade.classes[0], decade.sets[0]) if s == 0] == [str(y) for y in range(79, 100)]
    for pairs, name in ((yy, "yy"), (decade, "decade")):
        assert len(pairs) == 8 and pairs.variable == name and (pairs.target == 0).all()
        for k in range(8):
            b, s = _start(pairs.prompts[int(pairs.base[k])].prompt), _start(pairs.prompts[int(pairs.source[k])].prompt)
            assert _start(data[k].prompt) in (b, s)  # each prompt of the task is in its pair
            t = s if name == "yy" else 10 * (s // 10) + b % 10
            assert t >= b + 10
            assert [int(c) > t for c in pairs.classes[k]] == [v == 0 for v in pairs.sets[k]]
            assert pairs.labels[pairs.base[k]] == (b if name == "yy" else b // 10)
            # the base alone, its years uniform over b+1..99: mostly above t or not
            assert pairs.base_value[k] == (0 if sum(y > t for y in range(b + 1, 100)) > (99 - b) / 2 else 1)


def test_induction_pairs_by_hand():
    data = es.tasks.induction(n=6, seed=2)
    pairs = build_pairs(data, "token")
    assert len(pairs) == 12 and pairs.variable == "token"
    for k in range(12):
        base, src = pairs.prompts[int(pairs.base[k])].prompt.split(), pairs.prompts[int(pairs.source[k])].prompt.split()
        e = data[k % 6]
        L, cut = e.meta["period"], e.meta["k"]
        differ = [i for i in range(len(base)) if base[i] != src[i]]
        assert differ == [cut]  # the source differs only in the token the repeat copies next
        assert base[L:] == base[:cut] and src[L:] == src[:cut]  # both still cut at the same place
        assert pairs.classes[k] == [" " + base[cut], " " + src[cut]] and pairs.target[k] == 1
    assert [pairs.prompts[i].prompt for i in range(6)] == [e.prompt for e in data]


def test_unknown_variables_are_refused():
    with pytest.raises(es.errors.DataError, match="interchange_variable"):
        build_pairs(es.tasks.greater_than(n=8), "century")
    with pytest.raises(es.errors.DataError, match="interchange_variable"):
        build_pairs(es.tasks.induction(n=8), "position")


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_greater_than_full_interchange_at_the_last_layer_is_the_source_run(demo):
    data = es.tasks.greater_than(n=24, seed=1)
    last = demo.cfg.n_layers - 1
    op = es.Interchange(variable="decade", layers=[last], positions=["END"], bases=["pca"], placebo=False, seed=0)
    table = op.run(demo, data, quiet=True).table.set_index(["site", "basis"])
    pairs = build_pairs(data, "decade")
    held = np.flatnonzero(split(pairs, op.test_share, op.seed))
    ids = [demo.to_single_token(f"{y:02d}") for y in range(100)]
    hits = 0
    with torch.no_grad():
        for k in held:
            b = _start(pairs.prompts[int(pairs.base[k])].prompt)
            src = pairs.prompts[int(pairs.source[k])].prompt
            t = 10 * (_start(src) // 10) + b % 10
            logp = demo(src, return_type="logits")[0, -1, ids].log_softmax(-1)
            hits += int(logp[t + 1:].logsumexp(0) > logp[:t + 1].logsumexp(0))  # more mass above t than below
    assert table.loc[(f"resid_post.{last}@END", "full"), "iia"] == hits / len(held)
    assert hits / len(held) >= 0.75  # the demo model reads the start year


def test_induction_full_interchange_at_the_copied_token_is_a_hand_written_hook(demo):
    data = es.tasks.induction(n=16, seed=0)
    op = es.Interchange(variable="token", layers=[0], positions=["B1"], bases=["pca"], placebo=False, seed=0)
    table = op.run(demo, data, quiet=True).table.set_index(["site", "basis"])
    pairs = build_pairs(data, "token")
    held = np.flatnonzero(split(pairs, op.test_share, op.seed))
    hits = 0
    with torch.no_grad():
        for k in held:
            base, src = pairs.prompts[int(pairs.base[k])], pairs.prompts[int(pairs.source[k])]
            cut = base.meta["k"]
            tb, ts = demo.to_tokens(base.prompt), demo.to_tokens(src.prompt)
            at = int((tb[0] != ts[0]).nonzero()[0, 0])  # the one token where they differ: the copied word
            assert demo.to_string(tb[0, at]) == " " + base.meta["words"][cut]
            _, cache = demo.run_with_cache(ts, names_filter="blocks.0.hook_resid_post")
            vec = cache["blocks.0.hook_resid_post"][0, at].clone()

            def put(x, hook):
                x[0, at] = vec
                return x
            logits = demo.run_with_hooks(tb, fwd_hooks=[("blocks.0.hook_resid_post", put)])[0, -1]
            ids = [demo.to_single_token(t) for t in pairs.classes[k]]
            hits += int(logits[ids[1]] > logits[ids[0]])
    assert table.loc[("resid_post.0@B1", "full"), "iia"] == hits / len(held)
    assert hits / len(held) >= 0.75  # the demo model copies what followed the earlier occurrence


@pytest.mark.real
def test_greater_than_on_a_digit_tokenizer_is_refused_before_any_run(smollm2_folder):
    model = es.load_model(smollm2_folder)
    data = es.tasks.greater_than(n=8, tokenizer=model.tokenizer)  # years digit by digit: "00" is two tokens
    with pytest.raises(es.errors.DataError) as err:
        es.Interchange(variable="yy", layers=[0], bases=["pca"]).plan(model, data)
    assert err.value.code == "multi_token_answer" and "year tokens" in err.value.message


@pytest.mark.needs("nnsight")
def test_greater_than_das_trains_the_same_from_full_forwards_and_part_way_runs():
    """DAS on nnsight (every run a full forward: runs.train_das) and on the bridge (runs that start at the cell's
    block and token: runs._train_group) from the same seed and batches: the first epoch's mean loss over the
    year sets is the same number up to float error (a set logit read differently would differ by far more)."""
    data = es.tasks.greater_than(n=12, seed=0)
    op = es.Interchange(variable="yy", layers=[1], positions=["END"], bases=["das"], rank=2, epochs=2,
                        placebo=False, seed=0)
    losses = [op.run(es.load_model("demo", backend=b), data, quiet=True).extra["losses"][0]
              for b in ("bridge", "nnsight")]
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-4)
