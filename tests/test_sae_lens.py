"""Against SAELens itself, where it is installed (it pins transformer-lens < 4, so this runs in a
separate transformer-lens 3.9 environment with sae-lens added; the main CI environments lack it).

Our encoder equals sae_lens's on the same inputs, for SAE objects and for folders in both directions."""


import pytest

from extras import require
import torch

pytestmark = pytest.mark.slow  # sae-lens, installed in its own CI pass (CI runs them: -m slow)

sae_lens = require("sae_lens")

from entoscope.dictionaries import from_sae_lens, read_folder, register_dictionary, write_folder  # noqa: E402

D_IN, D_SAE = 16, 40


def _sae(arch: str, seed: int):
    from sae_lens import SAE

    cfg = {"architecture": arch, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": "blocks.1.hook_resid_post", "model_name": "tiny"}}
    if arch == "topk":
        cfg["k"] = 7
    sae = SAE.from_dict(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name == "r_mag" else 1.0))
            if name == "threshold":
                p.abs_()
    return sae


def _transcoder(arch: str, seed: int):
    from sae_lens import SAE

    cfg = {"architecture": arch, "d_in": D_IN, "d_sae": D_SAE, "d_out": 12, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": False, "normalize_activations": "none", "hook_name_out": "blocks.1.hook_mlp_out",
           "hook_layer_out": 1, "metadata": {"hook_name": "blocks.1.ln2.hook_normalized", "model_name": "tiny"}}
    sae = SAE.from_dict(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g))
            if name == "threshold":
                p.abs_()
    return sae


ARCHS = ["standard", "topk", "jumprelu", "gated"]


@pytest.mark.parametrize("arch", ARCHS)
def test_our_encoder_equals_sae_lens_on_the_same_inputs(arch):
    sae = _sae(arch, seed=ARCHS.index(arch))
    ours = from_sae_lens(sae)
    assert ours.architecture == arch and ours.hook_in == "resid_post.1" and ours.space == "processed"
    x = torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        theirs_f = sae.encode(x)
        theirs_x = sae.decode(theirs_f)
    f = ours.encode(x)
    torch.testing.assert_close(f, theirs_f, rtol=1e-5, atol=1e-5)
    assert torch.equal(f > 0, theirs_f > 0)
    torch.testing.assert_close(ours.decode(f), theirs_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["transcoder", "jumprelu_transcoder"])
def test_transcoders_equal_sae_lens(arch, tmp_path):
    from sae_lens import SAE

    tc = _transcoder(arch, seed=5)
    ours = from_sae_lens(tc)
    tc.save_model(tmp_path / "theirs")  # recent SAELens records d_out but not the output hook
    assert read_folder(tmp_path / "theirs").hook_out == "mlp_out.1"
    write_folder(ours, tmp_path / "ours")
    back = SAE.load_from_disk(str(tmp_path / "ours"))
    assert all(torch.equal(back.state_dict()[n], t) for n, t in ours.tensors().items())
    assert ours.is_transcoder and (ours.hook_in, ours.hook_out) == ("mlp_in.1", "mlp_out.1")
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = tc.encode(x)
    torch.testing.assert_close(ours.encode(x), theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.decode(ours.encode(x)), tc.decode(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_folders_cross_between_sae_lens_and_entoscope(arch, tmp_path):
    from sae_lens import SAE

    sae = _sae(arch, seed=10 + ARCHS.index(arch))
    sae.save_model(tmp_path / "theirs")
    ours = read_folder(tmp_path / "theirs")
    for name, t in ours.tensors().items():
        assert torch.equal(t, sae.state_dict()[name]), name
    write_folder(ours, tmp_path / "ours")
    back = SAE.load_from_disk(str(tmp_path / "ours"))
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(back.encode(x), sae.encode(x), rtol=0, atol=0)


def test_a_sae_lens_object_works_as_a_feature_site():
    import entoscope as es
    from entoscope.models.tiny import tiny_model

    model = tiny_model("gpt2", "hooked", False)
    d_model = model.cfg.d_model
    from sae_lens import SAE

    sae = SAE.from_dict({"architecture": "topk", "d_in": d_model, "d_sae": 32, "k": 4, "dtype": "float32",
                         "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
                         "metadata": {"hook_name": "blocks.0.hook_resid_post"}})
    register_dictionary("test_sae_lens_object", sae, replace=True)
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 6))
    m = es.adapt(model)
    out = m.run(tokens, ["features.0@test_sae_lens_object", "resid_post.0"])
    with torch.no_grad():
        torch.testing.assert_close(out["features.0@test_sae_lens_object"], sae.encode(out["resid_post.0"]))
    same = m.run(tokens, interventions=[es.Intervention("features.0@test_sae_lens_object", lambda f: f)])
    assert torch.equal(same.logits, out.logits)
