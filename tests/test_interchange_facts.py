"""The facts task's high-level causal model (variable `country`) on the demo model, checked against plain
forwards: the whole-vector interchange at resid_post of the last layer at the last token hands the logits
there the source run's own, so its IIA must equal the share of held-out pairs whose source prompt, run
alone, prefers the source's capital to the base's (counted here from the bridge's plain forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.data.tasks import vocab
from entoscope.interchange.causal import build_pairs, split


def test_facts_pairs_follow_the_country():
    data = es.tasks.facts(n=8, seed=3)
    pairs = build_pairs(data, "country")
    capital = dict(vocab.COUNTRIES)
    assert len(pairs) == 16 and pairs.variable == "country"
    for k in range(len(pairs)):
        b, s = pairs.prompts[int(pairs.base[k])], pairs.prompts[int(pairs.source[k])]
        e = data[k % 8]
        want_b, want_s = (e.meta["country"], e.meta["counterfactual_country"])[:: 1 if k < 8 else -1]
        assert (b.prompt, s.prompt) == ((e.prompt, e.counterfactual) if k < 8 else (e.counterfactual, e.prompt))
        assert pairs.classes[k] == [" " + capital[want_b], " " + capital[want_s]] and pairs.target[k] == 1
        assert vocab.COUNTRIES[pairs.labels[pairs.base[k]]][0] == want_b


def test_unknown_facts_variable_is_refused():
    with pytest.raises(es.errors.DataError, match="interchange_variable"):
        build_pairs(es.tasks.facts(n=8), "capital")


def test_full_interchange_at_the_last_layer_reproduces_the_source_run():
    model = es.load_model("demo")
    data = es.tasks.facts(n=16, seed=0)
    last = model.cfg.n_layers - 1
    op = es.Interchange(variable="country", layers=[last], positions=["SUBJ", "END"], bases=["pca"], rank=2,
                        placebo=False, seed=0)
    table = op.run(model, data).table.set_index(["site", "basis"])
    pairs = build_pairs(data, "country")
    held = np.flatnonzero(split(pairs, op.test_share, op.seed))
    hits = 0
    with torch.no_grad():
        for k in held:
            src = pairs.prompts[int(pairs.source[k])].prompt
            logits = model(src, return_type="logits")[0, -1]
            ids = [model.to_single_token(t) for t in pairs.classes[k]]
            hits += int(logits[ids[1]] > logits[ids[0]])  # the source's run alone gives the source's capital
    full = table.loc[(f"resid_post.{last}@END", "full")]
    assert full["n_pairs"] == len(held) == 16
    assert full["iia"] == hits / len(held)
    assert full["iia"] >= 0.8  # the demo model recalls the capitals: the variable is at the last token late
    assert table.loc[(f"resid_post.{last}@END", "none"), "iia"] == 0.0  # the base alone keeps its capital
