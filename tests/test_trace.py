"""es.trace: activations by site name, checked against each backend's own reads on the same prompts, one prompt
at a time: TransformerLens's run_with_cache under hook names written here (TransformerBridge plain and compat,
HookedTransformer), nnsight's own `.input` / `.output` saves at module paths written here, a CachedModel's entries
read back with the model unable to compute, a dictionary's features encoded by hand; and docs/trace.md's
examples, run."""

import linecache
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

import entoscope as es
from entoscope.dictionaries import Dictionary, register_dictionary
from entoscope.errors import EntoscopeError
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

PROMPTS = ["When Mary and John went to the store, John gave a drink to",
           "The capital of France is",
           "one two three four five six"]
TL_HOOKS = {  # canonical kind -> TransformerLens hook name (written here, not read from entoscope)
    "embed": "hook_embed", "resid_pre": "blocks.{L}.hook_resid_pre", "resid_mid": "blocks.{L}.hook_resid_mid",
    "resid_post": "blocks.{L}.hook_resid_post", "attn_out": "blocks.{L}.hook_attn_out",
    "mlp_out": "blocks.{L}.hook_mlp_out", "q": "blocks.{L}.attn.hook_q", "k": "blocks.{L}.attn.hook_k",
    "v": "blocks.{L}.attn.hook_v", "z": "blocks.{L}.attn.hook_z", "pattern": "blocks.{L}.attn.hook_pattern",
    "attn_scores": "blocks.{L}.attn.hook_attn_scores", "mlp_post": "blocks.{L}.mlp.hook_post",
    "ln1_scale": "blocks.{L}.ln1.hook_scale", "final_scale": "ln_final.hook_scale",
}
SITES = ["embed", "resid_*.*", "attn_out.1", "mlp_out.0", "q.1", "k.1", "v.1", "z.0", "pattern.1", "attn_scores.0",
         "mlp_post.1", "ln1_scale.0", "final_scale", "logits"]


def close(ours, theirs, what):
    ours, theirs = ours.detach(), theirs.detach()
    assert ours.shape == theirs.shape, what
    finite = torch.isfinite(theirs)
    assert torch.equal(finite, torch.isfinite(ours)), what
    scale = 1 + float(theirs[finite].abs().max())
    assert float((ours[finite] - theirs[finite]).abs().max()) <= 1e-5 * scale, what


def tl_name(site: str) -> str:
    kind, _, layer = site.partition(".")
    return TL_HOOKS[kind].format(L=layer)


def check_padding(tr):
    """Past each prompt's end every position axis holds 0 (-inf in attn_scores)."""
    for name, value in tr.items():
        for i, n in enumerate(tr.lengths.tolist()):
            row = value[i]
            fill = float("-inf") if name.startswith("attn_scores") else 0.0
            pos_axes = [0] if name.split(".")[0] not in ("pattern", "attn_scores") else [1, 2]
            for axis in pos_axes:
                tail = row.narrow(axis, n, row.shape[axis] - n)
                assert bool((tail == fill).all()), (name, i, axis)


# ------------------------------------------------------------------ TransformerLens models
def test_trace_equals_run_with_cache_prompt_by_prompt(tiny):
    tr = es.trace(tiny, PROMPTS, SITES, batch_size=2)  # two batches: pads inside one and across both
    assert "resid_post.1" in tr and "resid_pre.0" in tr and "logits" in tr
    assert len(tr.lengths) == 3 and len(set(tr.lengths.tolist())) == 3
    for i, prompt in enumerate(PROMPTS):
        tokens = tiny.to_tokens(prompt, prepend_bos=True)  # TransformerLens's own tokenising, BOS first
        assert tr.tokens[i, : tr.lengths[i]].tolist() == tokens[0].tolist()
        logits, cache = tiny.run_with_cache(tokens)
        for name in tr:
            theirs = logits[0] if name == "logits" else cache[tl_name(name)][0]
            close(tr.per_prompt(name)[i], theirs, (name, i))
    check_padding(tr)


def test_batching_does_not_change_the_padded_tensors():
    model = tiny_model("llama")
    one = es.trace(model, PROMPTS, ["resid_post.1", "pattern.0", "attn_scores.1"], batch_size=1)
    three = es.trace(model, PROMPTS, ["resid_post.1", "pattern.0", "attn_scores.1"], batch_size=3)
    for name in one:
        close(one[name], three[name], name)


def test_names_aliases_globs_and_sites_configs():
    model = tiny_model("gpt2")
    tr = es.trace(model, PROMPTS[:2], ["resid_post.*", "final_resid", "blocks.0.attn.hook_z",
                                       es.Sites(activation="mlp_out", layers=[1])])
    assert list(tr) == ["resid_post.0", "resid_post.1", "z.0", "mlp_out.1"]  # final_resid is resid_post.1: once
    assert tr["blocks.1.hook_resid_post"] is tr["resid_post.1"] is tr["layers_output[1]"] is tr["final_resid"]
    every = es.trace(model, PROMPTS[:1], "*.0")
    assert {"resid_pre.0", "z.0", "pattern.0", "result.0", "mlp_post.0"} <= set(every) and "resid_pre.1" not in every
    assert "attn_out.1" not in tr and "nonsense" not in tr
    with pytest.raises(KeyError) as err:
        tr["attn_out.1"]
    assert err.value.code == "site_not_traced"


@pytest.mark.parametrize("sites,code", [("resid_post", "layer_missing"), ("resid_post.7", "site_out_of_range"),
                                        ("hook_nothing", "unknown_activation"), ("mlp_*.9", "no_matching_sites"),
                                        ("pos_embed", "no_learned_positions"), ([], "empty_selection")])
def test_bad_sites_are_refused_before_any_forward(monkeypatch, sites, code):
    model = tiny_model("llama")

    def boom(*a, **k):
        raise AssertionError("ran a forward before refusing")
    monkeypatch.setattr(model, "run_with_cache", boom)
    monkeypatch.setattr(model, "forward", boom)
    with pytest.raises(EntoscopeError) as err:
        es.trace(model, PROMPTS, sites)
    assert err.value.code == code
    if code == "layer_missing":
        assert "resid_post.*" in err.value.remedy


def test_token_ids_are_used_as_given_and_positions_read_per_prompt():
    model = tiny_model("gpt2")
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 10, 11, 12, 13]])
    tr = es.trace(model, ids, ["resid_pre.1"])
    _, cache = model.run_with_cache(ids)
    close(tr["resid_pre.1"], cache["blocks.1.hook_resid_pre"], "ids")
    tr = es.trace(model, PROMPTS, ["resid_pre.1"])
    lengths = [len(model.to_tokens(p, prepend_bos=True)[0]) for p in PROMPTS]
    for i, n in enumerate(lengths):
        close(tr.at("resid_pre.1", -1)[i], tr["resid_pre.1"][i, n - 1], "last")
        close(tr.at("resid_pre.1", "END")[i], tr["resid_pre.1"][i, n - 1], "END")
        close(tr.at("resid_pre.1", 2)[i], tr["resid_pre.1"][i, 2], "index")
    with pytest.raises(EntoscopeError) as err:
        tr.at("resid_pre.1", 9)  # the second prompt has fewer tokens
    assert err.value.code == "site_out_of_range"
    with pytest.raises(EntoscopeError) as err:
        tr.at("resid_pre.1", "S2")
    assert err.value.code == "role_unknown"


def test_role_positions_from_a_template():
    model = tiny_model("gpt2")
    data = es.Dataset.from_template("When {IO} and {S} went to the store, {S} gave a drink to",
                                    [{"IO": "Mary", "S": "John"}, {"IO": "John", "S": "Mary"}])
    tr = es.trace(model, data, ["resid_post.0"])
    tok = tiny_tokenizer()
    for i, e in enumerate(data):
        end = e.roles["S2"][1]
        by_hand = len(tok(e.prompt[:end], add_special_tokens=False)["input_ids"])  # BOS first: its last token
        assert int(tr.positions("S2")[i]) == by_hand
        close(tr.at("resid_post.0", "S2")[i], tr["resid_post.0"][i, by_hand], "S2")


# ------------------------------------------------------------------ ActivationCache
def test_to_activation_cache_is_transformer_lens_own(tiny):
    tr = es.trace(tiny, PROMPTS[:1], ["resid_post.*", "pattern.1", "z.0", "logits"])
    with pytest.raises(EntoscopeError) as err:
        tr.to_activation_cache()
    assert err.value.code == "no_hook_name"
    cache = tr.to_activation_cache(names=["resid_post.0", "resid_post.1", "pattern.1", "z.0"])
    from transformer_lens import ActivationCache

    assert isinstance(cache, ActivationCache)
    keys = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.0.attn.hook_z"]
    assert sorted(cache.keys()) == sorted(keys)
    _, theirs = tiny.run_with_cache(tiny.to_tokens(PROMPTS[0], prepend_bos=True), names_filter=keys)
    for key in keys:
        close(cache[key], theirs[key], key)
    close(cache["resid_post", 1], theirs["resid_post", 1], "TransformerLens's own (kind, layer) lookup")


# ------------------------------------------------------------------ nnsight
_NN: dict = {}


def nnsight_model(family):
    """A tiny nnsight LanguageModel (skipped where nnsight is not installed, unless CI requires it)."""
    if os.environ.get("ENTOSCOPE_REQUIRE_NNSIGHT") != "1":
        pytest.importorskip("nnsight", reason="nnsight is an optional extra (pip install 'entoscope[nnsight]')")
    if family not in _NN:
        _NN[family] = from_hf(tiny_hf_model(family), tiny_tokenizer(), backend="nnsight", name=f"tiny-{family}")
    return _NN[family]


def nnsight_reads(nn, family, tokens):
    """nnsight's own reads, in forward order, at this family's module paths."""
    if family == "gpt2":
        embed, blocks = nn.transformer.wte, nn.transformer.h
        attn, o_proj = (lambda b: b.attn), (lambda b: b.attn.c_proj)
    elif family == "neox":
        embed, blocks = nn.gpt_neox.embed_in, nn.gpt_neox.layers
        attn, o_proj = (lambda b: b.attention), (lambda b: b.attention.dense)
    else:
        embed, blocks = nn.model.embed_tokens, nn.model.layers
        attn, o_proj = (lambda b: b.self_attn), (lambda b: b.self_attn.o_proj)
    a1 = attn(blocks[1])
    with nn.trace(tokens):
        embed_out = embed.output.save()
        resid_pre0 = blocks[0].input.save()
        z0 = o_proj(blocks[0]).input.save()
        mlp_out0 = blocks[0].mlp.output.save()
        resid_post0 = blocks[0].output.save()
        att = a1.output.save()
        resid_post1 = blocks[1].output.save()
        logits = nn.output.logits.save()
    out = {"embed": embed_out, "resid_pre.0": resid_pre0, "z.0": z0, "mlp_out.0": mlp_out0,
           "resid_post.0": resid_post0, "resid_post.1": resid_post1, "logits": logits,
           "attn_out.1": att[0], "pattern.1": att[1]}  # eager attention returns (output, weights)
    z = out["z.0"]
    out["z.0"] = z.view(*z.shape[:2], 4, z.shape[-1] // 4)
    return {k: v[0] for k, v in out.items()}


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_trace_equals_nnsight_own_reads(family):
    nn = nnsight_model(family)
    sites = ["embed", "resid_pre.0", "z.0", "mlp_out.0", "resid_post.*", "attn_out.1", "pattern.1", "logits"]
    tr = es.trace(nn, PROMPTS, sites, batch_size=2)
    tok = tiny_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        tokens = torch.tensor([[tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]])
        assert tr.tokens[i, : tr.lengths[i]].tolist() == tokens[0].tolist()
        theirs = nnsight_reads(nn, family, tokens)
        for name in tr:
            close(tr.per_prompt(name)[i], theirs[name], (family, name, i))
    check_padding(tr)
    with pytest.raises(EntoscopeError) as err:
        tr.to_activation_cache()
    assert err.value.code == "activation_cache_unavailable"


# ------------------------------------------------------------------ CachedModel
@pytest.mark.parametrize("kind", ["bridge", "nnsight"])
def test_a_cached_model_serves_a_trace_from_disk(monkeypatch, tmp_path, kind):
    model = tiny_model("gpt2") if kind == "bridge" else nnsight_model("gpt2")
    cached = es.CachedModel(model, tmp_path)
    sites = ["resid_post.*", "pattern.1", "z.0"]
    first = es.trace(cached, PROMPTS, sites, batch_size=2)
    plain = es.trace(model, PROMPTS, sites, batch_size=2)
    for name in first:
        close(first[name], plain[name], name)
    misses = cached.cache_stats()["misses"]
    assert misses == 2  # one entry per batch

    def boom(*a, **k):
        raise AssertionError("recomputed instead of read from the cache")
    monkeypatch.setattr(cached._target, "run_with_cache", boom)  # the wrapped model can no longer compute
    again = es.trace(cached, PROMPTS, sites, batch_size=2)
    assert all(torch.equal(first[k], again[k]) for k in first)
    stats = cached.cache_stats()
    assert stats["hits"] == 2 and stats["misses"] == misses


# ------------------------------------------------------------------ feature sites
@pytest.fixture(scope="module")
def random_sae():
    g = torch.Generator().manual_seed(3)
    d = Dictionary("standard", torch.randn(64, 96, generator=g) / 8, torch.randn(96, 64, generator=g) / 8,
                   torch.randn(64, generator=g) / 8, "resid_post.0", "resid_post.0",
                   b_enc=torch.randn(96, generator=g) / 8, space="any")
    register_dictionary("test-trace/resid_post.0", d, replace=True)
    return d


@pytest.mark.parametrize("kind", ["bridge", "nnsight"])
def test_feature_sites_are_the_dictionary_encoding_by_hand(random_sae, kind):
    model = tiny_model("gpt2") if kind == "bridge" else nnsight_model("gpt2")
    tr = es.trace(model, PROMPTS, ["features.0@test-trace/resid_post.0", "resid_post.0"])
    W_enc, b_enc, b_dec = random_sae.W_enc, random_sae.b_enc, random_sae.b_dec
    for i, prompt in enumerate(PROMPTS):
        if kind == "bridge":
            _, cache = model.run_with_cache(model.to_tokens(prompt, prepend_bos=True))
            x = cache["blocks.0.hook_resid_post"][0]
        else:
            tok = tiny_tokenizer()
            x = nnsight_reads(model, "gpt2", torch.tensor([[0] + tok(prompt, add_special_tokens=False)["input_ids"]]))[
                "resid_post.0"]
        by_hand = torch.relu((x - b_dec) @ W_enc + b_enc)  # a standard SAE (Bricken et al. 2023)
        close(tr.per_prompt("features.0@test-trace/resid_post.0")[i], by_hand, (kind, i))
    check_padding(tr)


# ------------------------------------------------------------------ the page
def test_the_trace_pages_examples_run(monkeypatch):
    page = Path(__file__).resolve().parent.parent / "docs" / "trace.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tempfile.mkdtemp())
    namespace: dict = {}
    for i, block in enumerate(blocks):
        name = f"<{page.name} block {i + 1}>"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)
        exec(compile(block, name, "exec"), namespace)
