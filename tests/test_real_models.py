"""The real pretrained models (SmolLM2-135M, Llama family; Gemma 3 270M), dequantized from the GGUF files in
their PyPI packages (scripts/fetch_real_models.py): the fixture against transformers' own reading of the GGUF,
`load_model` on a .gguf file, and entoscope's numbers against plain transformers with hooks written here (the
logit lens, exact head patching, DLA's identity, head scores), then every operation on every model kind.

The `real` marker: CI runs these (`-m "slow or not slow"`); the README's plain test command leaves them out
(`-m real` runs them). Without PyPI the fixture skips with one line saying how to fetch.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import entoscope as es
from entoscope.models import adapt, load_model

from conftest import has_hooked_transformer
from extras import require

pytestmark = pytest.mark.real

_HF: dict = {}
_ES: dict = {}


def hf_model(folder):
    """transformers' own model from the folder (eager attention, so attention weights can be read)."""
    from transformers import AutoModelForCausalLM

    if folder not in _HF:
        _HF[folder] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return _HF[folder]


def es_model(folder, backend="bridge", compat=False):
    key = (folder, backend, compat)
    if key not in _ES:
        _ES[key] = load_model(str(folder), backend=backend, compat=compat)
    return _ES[key]


def layer_outputs(hf, tokens):
    """Each decoder layer's output (the residual stream after block l) and the logits, by forward hooks."""
    outs, handles = {}, []
    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.register_forward_hook(
            lambda mod, inp, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach())))
    try:
        with torch.no_grad():
            logits = hf(tokens).logits
    finally:
        for h in handles:
            h.remove()
    return [outs[i] for i in range(len(outs))], logits


def ioi(n, seed=0):
    return es.tasks.ioi(n=n, seed=seed)


# ------------------------------------------------------------------------------------------------ the fixture

def test_folder_is_the_gguf_models_own_dequantization_and_a_trained_model(real_folder):
    """The saved folder's logits equal transformers' reading of the GGUF file itself (0 difference), the file's
    SHA-256 is the pinned one (hashed here), and the model does IOI (the model is trained, not random)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((real_folder / "entoscope_gguf.json").read_text())
    gguf = real_folder.parent / "gguf" / record["gguf"]
    h = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert h == record["sha256"]
    import fetch_real_models

    assert h in {spec["sha256"] for spec in fetch_real_models.MODELS.values()}
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    saved = hf_model(real_folder).state_dict()
    for name, value in direct.state_dict().items():
        assert torch.equal(saved[name], value), name
    tok = AutoTokenizer.from_pretrained(str(real_folder))
    ids = tok("When Mary and John went to the store, John gave a drink to", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = direct(ids).logits
        got = hf_model(real_folder)(ids).logits
    assert float((got - expected).abs().max()) == 0.0
    mary = tok(" Mary", add_special_tokens=False).input_ids[0]
    assert float(got[0, -1].softmax(-1)[mary]) > 0.5


def test_load_model_reads_a_gguf_file_and_records_its_quantization(smollm2_folder, tmp_path, monkeypatch):
    record = json.loads((smollm2_folder / "entoscope_gguf.json").read_text())
    gguf = smollm2_folder.parent / "gguf" / record["gguf"]
    monkeypatch.setenv("ENTOSCOPE_GGUF_CACHE", str(tmp_path / "cache"))
    model = load_model(str(gguf))
    a = adapt(model)
    assert a.structure.quantization == "GGUF Q4_1"
    assert "dequantized from GGUF Q4_1" in a.structure.describe()
    tokens = torch.tensor([a.tokenize("The capital of France is")])
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(smollm2_folder)(tokens).logits
    assert float((ours - theirs).abs().max()) < 1e-4
    result = es.DirectLogitAttribution().run(model, ioi(2), quiet=True)
    saved = result.save(tmp_path / "dla")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["model"]["structure"]["quantization"] == "GGUF Q4_1"
    assert manifest["model"]["source"]["name"] == str(gguf)
    assert a.name == manifest["model"]["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # general.name, not the cache path


def test_a_gguf_file_reuses_the_folder_the_fetch_script_made(smollm2_folder, tmp_path, monkeypatch):
    """dequantized_folder(file, folder) (what scripts/fetch_real_models.py calls) enters the folder in the GGUF cache's
    index; a later dequantized_folder(file) (load_model("file.gguf"), the report) finds it there instead of
    converting the file again into a second 538 MB copy."""
    from entoscope.models import gguf

    record = json.loads((smollm2_folder / "entoscope_gguf.json").read_text())
    file = smollm2_folder.parent / "gguf" / record["gguf"]
    monkeypatch.setenv("ENTOSCOPE_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_read", lambda p: (_ for _ in ()).throw(AssertionError("converted again")))
    assert gguf.dequantized_folder(file, smollm2_folder) == smollm2_folder  # intact: kept, and entered in the index
    assert gguf.dequantized_folder(file) == smollm2_folder.resolve()
    assert [f.name for f in (tmp_path / "cache").iterdir()] == ["by-sha256"]


# ------------------------------------------------------------------- numbers against plain transformers

def test_logit_lens_equals_final_norm_and_unembedding_of_each_layers_output(real_folder):
    model, hf = es_model(real_folder), hf_model(real_folder)
    a = adapt(model)
    data = ioi(3, seed=1)
    L = a.structure.n_layers
    layers = [0, L // 2, L - 2, L - 1]
    result = es.Lens(sites=es.Sites(activation="resid_post", layers=layers, over=["layer"])).run(
        model, data, quiet=True)
    pp = result.per_prompt
    for i, ex in enumerate(data):
        tokens = torch.tensor([a.tokenize(ex.prompt)])
        outs, logits = layer_outputs(hf, tokens)
        target = a.token_id(ex.answers[0])
        for layer in layers:
            with torch.no_grad():
                expected = hf.lm_head(hf.model.norm(outs[layer]))[0, -1, target]
            got = float(pp[(pp.example == i) & (pp.layer == layer)].target_logit.iloc[0])
            assert abs(got - float(expected)) <= 2e-3 * max(1.0, abs(float(expected))), (layer, got, float(expected))
        assert abs(float(logits[0, -1, target]) - got) <= 2e-3 * max(1.0, abs(got))  # the last layer: the logits


def _patched_logit_diff(hf, tokens, layer, head, source_z, d_head, ans, wrong):
    """The logit difference at the last token with head `head` of layer `layer` given the source run's z (the
    o_proj input), by a pre-hook on o_proj written here."""
    o_proj = hf.model.layers[layer].self_attn.o_proj

    def put(mod, args):
        z = args[0].clone()
        z[..., head * d_head:(head + 1) * d_head] = source_z[..., head * d_head:(head + 1) * d_head]
        return (z,)

    handle = o_proj.register_forward_pre_hook(put)
    try:
        with torch.no_grad():
            logits = hf(tokens).logits[0, -1]
    finally:
        handle.remove()
    return float(logits[ans] - logits[wrong])


def _z_of(hf, tokens, layer):
    seen = {}
    o_proj = hf.model.layers[layer].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda mod, args: seen.__setitem__("z", args[0].detach()))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        handle.remove()
    return seen["z"]


def test_exact_head_patching_equals_a_hook_on_the_output_projection(real_folder):
    model, hf = es_model(real_folder), hf_model(real_folder)
    a = adapt(model)
    s = a.structure
    data = ioi(3, seed=2)
    heads = [(s.n_layers - 7, 0), (s.n_layers - 7, s.n_heads - 1), (s.n_layers // 2, 1)]
    layers = sorted({layer for layer, _ in heads})
    result = es.Patching(sites=es.Sites(activation="z", layers=layers, over=["layer", "head"]),
                         comparison="absolute").run(model, data, quiet=True)
    table = result.table.reset_index(drop=True)
    for i, ex in enumerate(data):
        clean = torch.tensor([a.tokenize(ex.prompt)])
        corrupt = torch.tensor([a.tokenize(ex.counterfactual)])
        ans, wrong = a.token_id(ex.answers[0]), a.token_id(ex.wrong_answers[0])
        for layer, head in heads:
            source = _z_of(hf, clean, layer)
            if source.shape[1] != corrupt.shape[1]:
                continue  # pairs of different lengths align on their ends (covered on the demo model)
            expected = _patched_logit_diff(hf, corrupt, layer, head, source, s.d_head, ans, wrong)
            unit = table.index[(table["layer"] == layer) & (table["head"] == head)][0]
            got = float(result.extra["patched"][i, unit])
            assert abs(got - expected) <= 2e-3 * max(1.0, abs(expected)), (layer, head, got, expected)


def test_dla_rows_add_up_to_the_models_logit_difference(real_folder):
    model, hf = es_model(real_folder), hf_model(real_folder)
    a = adapt(model)
    data = ioi(3, seed=3)
    result = es.DirectLogitAttribution().run(model, data, quiet=True)
    pp = result.per_prompt
    for i, ex in enumerate(data):
        tokens = torch.tensor([a.tokenize(ex.prompt)])
        with torch.no_grad():
            logits = hf(tokens).logits[0, -1].double()
        ans, wrong = a.token_id(ex.answers[0]), a.token_id(ex.wrong_answers[0])
        expected = float(logits[ans] - logits[wrong])
        total = float(pp[pp.example == i].contribution.sum())  # no unembedding bias, no norm bias: no constant
        assert abs(total - expected) <= 2e-3 * max(1.0, abs(expected)), (total, expected)


def test_previous_token_scores_equal_transformers_attention_weights(real_folder):
    model, hf = es_model(real_folder), hf_model(real_folder)
    a = adapt(model)
    data = es.tasks.induction(n=3, seed=0)
    result = es.HeadScores(kinds=["previous_token"]).run(model, data, quiet=True)
    table = result.table.set_index(["layer", "head"])["score"]
    per_prompt = []
    for ex in data:
        tokens = torch.tensor([a.tokenize(ex.prompt)])
        with torch.no_grad():
            att = hf(tokens, output_attentions=True).attentions  # per layer [1, H, T, T]
        T = tokens.shape[1]
        q = torch.arange(1, T)
        per_prompt.append(torch.stack([layer[0][:, q, q - 1].mean(-1) for layer in att]))  # [L, H]
    expected = torch.stack(per_prompt).double().mean(0)
    got = torch.tensor([[table[(layer, head)] for head in range(expected.shape[1])]
                        for layer in range(expected.shape[0])], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


# ------------------------------------------------------------------- every operation on every model kind

KINDS = ["bridge", "compat", "nnsight", "cached"] + (["hooked"] if has_hooked_transformer() else [])


def kind_model(folder, kind, tmp_path):
    if kind == "hooked":
        return es_model(folder, "hooked")
    if kind == "compat":
        return es_model(folder, "bridge", compat=True)
    if kind == "nnsight":
        require("nnsight")
        return es_model(folder, "nnsight")
    if kind == "cached":
        return es.CachedModel(es_model(folder), cache_dir=tmp_path / "cache")
    return es_model(folder)


_PLAIN: dict = {}


def plain_run(folder, key, op, data):
    """An operation's run on the plain bridge, once per model and operation (the reference of every kind)."""
    if (folder, key) not in _PLAIN:
        _PLAIN[(folder, key)] = op.run(es_model(folder), data, quiet=True)
    return _PLAIN[(folder, key)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_operation_runs_and_agrees_with_the_plain_bridge(real_folder, kind, tmp_path):
    """Each operation at small n on each model kind; where the numbers mean the same on two kinds (logit
    differences and the final logits, which no folding changes; every number for nnsight and CachedModel,
    which read HuggingFace's own activations as the plain bridge does), they equal the plain bridge's."""
    if kind == "hooked" and (real_folder / "config.json").read_text().count('"gemma3'):
        from entoscope.errors import UnsupportedModelError  # TL 3.9's HookedTransformer has no Gemma 3

        with pytest.raises(UnsupportedModelError) as err:
            kind_model(real_folder, kind, tmp_path)
        assert err.value.code == "family_unsupported"
        return
    model = kind_model(real_folder, kind, tmp_path)
    a = adapt(model)
    L = a.structure.n_layers
    data = ioi(3, seed=4)
    same_numbers = kind in ("nnsight", "cached")

    def close(x, y, tol=2e-3):
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        assert torch.isfinite(x).all()
        assert float((x - y).abs().max()) <= tol * max(1.0, float(y.abs().max()))

    def both(key, op, on=data):
        return op.run(model, on, quiet=True), plain_run(real_folder, key, op, on)

    got, ref = both("lens", es.Lens(sites=es.Sites(activation="resid_post", layers=[L // 2, L - 1], over=["layer"])))
    close(got.table.kl_mean.to_numpy(), ref.table.kl_mean.to_numpy()) if same_numbers else \
        close(got.table.kl_mean.to_numpy()[-1:], 0.0)

    got, ref = both("exact", es.Patching(sites=es.Sites(activation="z", layers=[L - 7], over=["layer", "head"]),
                                         comparison="absolute"))
    close(got.extra["patched"], ref.extra["patched"])

    got, ref = both("attribution", es.Patching(method="attribution",
                                               sites=es.Sites(activation="resid_pre", over=["layer"])))
    if same_numbers:
        close(got.table.value.to_numpy(), ref.table.value.to_numpy())

    got, ref = both("dla", es.DirectLogitAttribution())
    close(got.per_prompt.groupby("example").contribution.sum().to_numpy(),
          ref.per_prompt.groupby("example").contribution.sum().to_numpy())

    got, ref = both("heads", es.HeadScores(kinds=["previous_token"]), es.tasks.induction(n=2))
    close(got.table.score.to_numpy(), ref.table.score.to_numpy())

    ifr = es.InformationFlowRoutes().run(model, ioi(1), quiet=True)
    assert len(ifr.table) > 0 and ifr.table.importance_mean.notna().all()

    circuits = es.Circuits(method="eap", n_edges=10, faithfulness=[]).run(model, ioi(1), quiet=True)
    assert len(circuits.table) > 0 and torch.isfinite(torch.tensor(circuits.table.score.to_numpy())).all()

    probing = es.Probing(sites=es.Sites(activation="resid_post", layers=[L // 2], over=["layer"]))
    assert len(probing.run(model, es.tasks.ioi(n=40, seed=5), quiet=True).table) > 0

    steering = es.Steering(direction={"source": "mean_difference", "site": f"resid_pre.{L // 2}",
                                      "data": {"task": "ioi", "n": 4, "seed": 100}},
                           coefficients=[1.0], metric="logit_diff", side_effects=None)
    assert len(steering.run(model, ioi(2), quiet=True).table) > 0
