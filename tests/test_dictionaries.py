"""Dictionaries: SAELens folders read and written, the four encoders, refusals, training, the CLI.

Encoders are checked against computations written here from the papers' definitions (a sort for
top-k, explicit masks for JumpReLU and gated), not against the code under test."""

import json

import pytest
import torch
from safetensors.torch import save_file

from entoscope.dictionaries import Dictionary, read_folder, write_folder
from entoscope.dictionaries.train import TrainConfig, fit, quality
from entoscope.errors import DictionaryError

D_IN, D_SAE = 8, 24


def random_dictionary(arch: str, seed: int = 0, hook_out: str = "resid_post.1", d_out: int = D_IN) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    extra = {"standard": {"b_enc": r(D_SAE)}, "topk": {"b_enc": r(D_SAE), "k": 5},
             "jumprelu": {"b_enc": r(D_SAE), "threshold": r(D_SAE).abs()},
             "gated": {"b_gate": r(D_SAE), "r_mag": 0.3 * r(D_SAE), "b_mag": r(D_SAE)}}[arch]
    hook_in = "resid_post.1" if hook_out == "resid_post.1" else "mlp_in.1"
    return Dictionary(arch, r(D_IN, D_SAE), r(D_SAE, d_out), r(d_out), hook_in, hook_out, space="any", **extra)


def reference_encode(d: Dictionary, x: torch.Tensor) -> torch.Tensor:
    """The encoders from their definitions, row by row (slow and plain on purpose)."""
    xc = x - d.b_dec if (d.apply_b_dec_to_input and not d.is_transcoder) else x
    rows = []
    for row in xc:
        if d.architecture == "gated":
            gate = (row @ d.W_enc + d.b_gate) > 0
            mag = torch.clamp(row @ (d.W_enc * torch.exp(d.r_mag)) + d.b_mag, min=0)
            rows.append(torch.where(gate, mag, torch.zeros_like(mag)))
            continue
        pre = row @ d.W_enc + d.b_enc
        if d.architecture == "standard":
            rows.append(torch.clamp(pre, min=0))
        elif d.architecture == "jumprelu":
            rows.append(torch.where(pre > d.threshold, pre, torch.zeros_like(pre)).clamp(min=0))
        else:
            kth = torch.sort(pre, descending=True).values[d.k - 1]
            rows.append(torch.where(pre >= kth, pre, torch.zeros_like(pre)).clamp(min=0))
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_encoders_match_their_definitions(arch):
    d = random_dictionary(arch)
    x = torch.randn(40, D_IN, generator=torch.Generator().manual_seed(1))
    f = d.encode(x)
    torch.testing.assert_close(f, reference_encode(d, x), rtol=1e-6, atol=1e-6)
    if arch == "topk":
        assert int((f > 0).sum(-1).max()) <= d.k
    recon = x.new_zeros(len(x), D_IN) + d.b_dec
    for i in range(D_SAE):  # decode: a sum of decoder rows weighted by the features
        recon = recon + f[:, i:i + 1] * d.W_dec[i]
    torch.testing.assert_close(d.decode(f), recon, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.decode(f) + d.error(x), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_saelens_folder_round_trip_keeps_every_weight(arch, tmp_path):
    d = random_dictionary(arch)
    write_folder(d, tmp_path / arch, model_name="tiny")
    cfg = json.loads((tmp_path / arch / "cfg.json").read_text())
    assert cfg["architecture"] == arch and cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    back = read_folder(tmp_path / arch)
    assert back.architecture == arch and back.hook_in == back.hook_out == "resid_post.1" and back.k == d.k
    assert back.tensors().keys() == d.tensors().keys()
    for name, t in d.tensors().items():
        assert torch.equal(back.tensors()[name], t), name


def test_transcoder_folder_round_trip(tmp_path):
    d = random_dictionary("standard", hook_out="mlp_out.1", d_out=6)
    write_folder(d, tmp_path / "tc")
    cfg = json.loads((tmp_path / "tc" / "cfg.json").read_text())
    assert cfg["architecture"] == "transcoder" and cfg["hook_name_out"] == "blocks.1.hook_mlp_out"
    assert cfg["metadata"]["hook_name"] == "blocks.1.ln2.hook_normalized" and cfg["d_out"] == 6
    back = read_folder(tmp_path / "tc")
    assert back.is_transcoder and (back.hook_in, back.hook_out) == ("mlp_in.1", "mlp_out.1")
    assert all(torch.equal(back.tensors()[n], t) for n, t in d.tensors().items())


def _hand_folder(path, cfg, weights):
    path.mkdir(parents=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "sae_weights.safetensors"))
    return path


def test_pre_6_flat_layout_with_topk_as_activation_function(tmp_path):
    """Written here by hand in the layout SAELens used before 6.0 (hook_point, activation_fn_str/kwargs)."""
    g = torch.Generator().manual_seed(3)
    w = {"W_enc": torch.randn(D_IN, D_SAE, generator=g), "W_dec": torch.randn(D_SAE, D_IN, generator=g),
         "b_enc": torch.randn(D_SAE, generator=g), "b_dec": torch.randn(D_IN, generator=g)}
    cfg = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "hook_point": "blocks.0.hook_resid_pre",
           "hook_point_layer": 0, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3},
           "apply_b_dec_to_input": False, "normalize_activations": "none", "dtype": "float32"}
    d = read_folder(_hand_folder(tmp_path / "old", cfg, w))
    assert all(torch.equal(d.tensors()[k], v) for k, v in w.items())
    assert (d.architecture, d.k, d.hook_in, d.apply_b_dec_to_input, d.space) == ("topk", 3, "resid_pre.0", False,
                                                                               "processed")
    x = torch.randn(5, D_IN, generator=g)
    pre = x @ w["W_enc"] + w["b_enc"]
    kth = pre.sort(dim=-1, descending=True).values[:, 2:3]
    torch.testing.assert_close(d.encode(x), torch.where(pre >= kth, pre.clamp(min=0), 0.0))


@pytest.mark.parametrize("change, code", [
    ({"architecture": "batchtopk"}, "dictionary_architecture_unsupported"),
    ({"architecture": "skip_transcoder"}, "dictionary_architecture_unsupported"),
    ({"normalize_activations": "expected_average_only_in"}, "dictionary_option_unsupported"),
    ({"reshape_activations": "hook_z"}, "dictionary_option_unsupported"),
    ({"rescale_acts_by_decoder_norm": True}, "dictionary_option_unsupported"),
    ({"d_sae": D_SAE + 1}, "dictionary_shape_mismatch"),
    ({"metadata": {"hook_name": "blocks.0.hook_attn_in"}}, "dictionary_hook_unknown"),
    ({"metadata": {}}, "dictionary_format_invalid"),
])
def test_unsupported_folders_are_refused_by_name(tmp_path, change, code):
    d = random_dictionary("standard")
    write_folder(d, tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "cfg.json").read_text())
    cfg.update(change)
    (tmp_path / "ok" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(DictionaryError) as err:
        read_folder(tmp_path / "ok")
    assert err.value.code == code


def test_missing_folder_is_refused(tmp_path):
    from entoscope.dictionaries import get_dictionary

    with pytest.raises(DictionaryError) as err:
        get_dictionary(str(tmp_path / "nothing"))
    assert err.value.code == "dictionary_not_found"


def test_training_fits_a_planted_sparse_code_and_repeats_exactly():
    """Rows are sums of 2 of 16 planted directions: a top-k SAE with k=2 trained a few dozen steps
    explains most of their variance; the same seed gives the same weights bit for bit."""
    g = torch.Generator().manual_seed(0)
    atoms = torch.nn.functional.normalize(torch.randn(16, D_IN, generator=g), dim=1)
    idx = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(2048)])
    x = (atoms[idx] * (1 + torch.rand(2048, 2, 1, generator=g))).sum(1)
    cfg = TrainConfig(d_sae=32, k=2, steps=60, batch_tokens=256, lr=1e-2, seed=1)
    w1, losses = fit(x, x, cfg, sae=True)
    w2, _ = fit(x, x, cfg, sae=True)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert losses[-1] < 0.5 * losses[0]
    d = Dictionary("topk", w1["W_enc"], w1["W_dec"], w1["b_dec"], "resid_post.0", "resid_post.0",
                   b_enc=w1["b_enc"], k=2, space="any")
    q = quality(d, x, x)
    f = d.encode(x).numpy()
    recon = f @ d.W_dec.numpy() + d.b_dec.numpy()
    xs = x.numpy()
    ev = 1 - ((xs - recon) ** 2).sum() / ((xs - xs.mean(0)) ** 2).sum()
    assert q["l0"] == pytest.approx((f > 0).sum(1).mean()) and q["l0"] <= 2
    assert q["explained_variance"] == pytest.approx(ev, rel=1e-4) and ev > 0.5
    assert q["dead_fraction"] == pytest.approx(1 - (f > 0).any(0).mean())


def test_standard_training_folds_decoder_norms_without_changing_the_map():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, D_IN, generator=g)
    w, _ = fit(x, x, TrainConfig(architecture="standard", d_sae=16, steps=20, batch_tokens=128, seed=0), sae=True)
    torch.testing.assert_close(w["W_dec"].norm(dim=1), torch.ones(16))


def test_train_sae_command_writes_a_loadable_folder(tmp_path, capsys):
    from entoscope.cli import main

    out = tmp_path / "sae"
    rc = main(["train-sae", "--model", "demo", "--site", "mlp_in.1", "--target", "mlp_out.1", "--n", "4",
               "--d-sae", "32", "--k", "4", "--steps", "15", "--batch-tokens", "64", "--out", str(out)])
    assert rc == 0 and "explained variance" in capsys.readouterr().out
    d = read_folder(out)
    report = json.loads((out / "training_report.json").read_text())
    # a transcoder trains as standard (ReLU + L1): SAELens's format has no top-k transcoder
    assert (d.hook_in, d.hook_out, d.d_sae, d.architecture, d.space) == ("mlp_in.1", "mlp_out.1", 32, "standard", "plain")
    assert report["config"]["steps"] == 15 and report["config"]["architecture"] == "standard"
    assert 0 < report["quality"]["l0"] <= 32 and report["train_tokens"] > 0


def test_a_top_k_transcoder_is_refused_before_training():
    import entoscope as es
    from entoscope.errors import ConfigError
    from entoscope.dictionaries.train import train_dictionary

    with pytest.raises(ConfigError) as err:
        train_dictionary(es.load_model("demo"), [[0, 5, 6]], "mlp_in.0", "mlp_out.0", TrainConfig(architecture="topk"))
    assert err.value.code == "train_architecture_unsupported"


def test_loss_recovered_is_one_for_an_exact_dictionary_and_zero_for_an_empty_one():
    """An SAE with W_enc = [I, -I], W_dec = [I; -I] reconstructs exactly (ReLU(x) - ReLU(-x) = x); one whose
    decoder is zero reconstructs zero, as the zero ablation does."""
    import entoscope as es
    from entoscope.dictionaries.evaluate import loss_recovered
    from entoscope.dictionaries.train import prompts_of, task_data

    model = es.load_model("demo")
    D = model.cfg.d_model
    eye = torch.eye(D)
    exact = Dictionary("standard", torch.cat([eye, -eye], 1), torch.cat([eye, -eye], 0), torch.zeros(D),
                       "resid_post.1", "resid_post.1", b_enc=torch.zeros(2 * D), space="any")
    empty = Dictionary("standard", torch.cat([eye, -eye], 1), torch.zeros(2 * D, D), torch.zeros(D),
                       "resid_post.1", "resid_post.1", b_enc=torch.zeros(2 * D), space="any")
    data = task_data(model, ["ioi", "facts"], n=4, seed=0)
    prompts = prompts_of(model, data)
    full, none = loss_recovered(model, exact, prompts, data), loss_recovered(model, empty, prompts, data)
    for kind in ("next_token", "answer"):
        assert full[f"{kind}_loss_spliced"] == pytest.approx(full[f"{kind}_loss_clean"], abs=1e-5)
        assert full[f"{kind}_loss_recovered"] == pytest.approx(1.0, abs=1e-3)
        assert none[f"{kind}_loss_spliced"] == pytest.approx(none[f"{kind}_loss_zeroed"], abs=1e-6)
        assert none[f"{kind}_loss_recovered"] == pytest.approx(0, abs=1e-6)
        assert none[f"{kind}_loss_zeroed"] > none[f"{kind}_loss_clean"] + 0.5


def test_answer_loss_is_the_log_probability_of_the_answers():
    """By hand for a few IOI prompts: -log softmax(logits at the last token)[answer]."""
    import entoscope as es
    from entoscope.dictionaries.evaluate import answer_loss
    from entoscope.models.adapter import adapt

    model = es.load_model("demo")
    m = adapt(model)
    data = es.tasks.ioi(n=3)
    by_hand = []
    for e in data:
        with torch.no_grad():
            logits = model(torch.tensor([m.tokenize(e.prompt)]), return_type="logits")[0, -1]
        by_hand.append(-torch.log_softmax(logits, -1)[m.token_id(e.answers[0])])
    assert answer_loss(model, [data]) == pytest.approx(float(torch.stack(by_hand).mean()), rel=1e-5)
