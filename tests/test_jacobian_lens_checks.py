"""What a Jacobian lens refuses (lens/jacobian.py, jacobian_fit.py): a hand-edited file, a lens fitted on another
model of the same shape, a merge that would count prompts twice, an empty list of layers; and the command line's
`train-lens --corpus`, which lets fits on parts of one corpus merge."""

import json
import math

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.errors import EntoscopeError, EntoscopeWarning
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

from conftest import get_tiny, has_hooked_transformer


def _texts(n: int, T: int = 8, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset("random", tuple(Example(tuple([0] + torch.randint(1, 300, (T - 1,), generator=g).tolist()))
                                   for _ in range(n)))


@pytest.fixture(scope="module")
def lens_file(tmp_path_factory):
    """A lens fitted on the session's tiny GPT-2 (plain bridge), saved."""
    lens = es.JacobianLens.fit(get_tiny("gpt2", "bridge", False), _texts(2), skip_first=1, quiet=True)
    return lens.save(tmp_path_factory.mktemp("jl") / "lens.pt")


def _edited(src, dst, edit):
    payload = torch.load(src, weights_only=True)
    edit(payload)
    torch.save(payload, dst)
    return dst


# ------------------------------------------------------------------ a hand-edited file
@pytest.mark.parametrize("field, edit", [
    ("n_prompts", lambda p: p.update(n_prompts="four")),
    ("keyed", lambda p: p.update(J={f"layer{k}": v for k, v in p["J"].items()})),
    ("metadata", lambda p: p.update(metadata=["model_name", "tiny-gpt2"])),
    ("target_layer", lambda p: p["metadata"].update(target_layer="1")),
    ("d_model", lambda p: p.update(d_model=[64])),
])
def test_a_hand_edited_file_is_refused_naming_what_is_wrong(lens_file, tmp_path, field, edit):
    bad = _edited(lens_file, tmp_path / "bad.pt", edit)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLens.load(bad)
    assert err.value.code == "jacobian_lens_corrupt" and field in str(err.value), str(err.value)
    assert "targets layer" not in str(err.value)


def test_an_edited_file_with_the_same_values_spelled_otherwise_still_loads(lens_file, tmp_path):
    """Layer keys as decimal text and a whole-number float n_prompts are the same values: read as such."""
    same = _edited(lens_file, tmp_path / "same.pt",
                   lambda p: p.update(J={str(k): v for k, v in p["J"].items()}, n_prompts=2.0))
    lens, orig = es.JacobianLens.load(same), es.JacobianLens.load(lens_file)
    assert lens.source_layers == orig.source_layers == [0] and lens.n_prompts == 2
    assert torch.equal(lens.jacobians[0], orig.jacobians[0])


def test_the_command_line_refuses_a_hand_edited_lens_in_one_line(lens_file, tmp_path, capsys):
    from entoscope.cli import main

    bad = _edited(lens_file, tmp_path / "bad.pt", lambda p: p["metadata"].update(target_layer="1"))
    capsys.readouterr()
    assert main(["lens", "--model", "demo", "--method", "jacobian", "--lens", str(bad), "--data",
                 "{task: ioi, n: 2}", "--plan"]) == 2
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "warning:" not in e]
    assert len(err) == 1 and "[jacobian_lens_corrupt]" in err[0] and "target_layer" in err[0], err
    assert err[0].startswith("entoscope: error:") and "Traceback" not in err[0]


# ------------------------------------------------------------------ which model the lens belongs to
def test_a_lens_fitted_on_another_model_of_the_same_shape_is_refused(lens_file):
    """A re-seeded tiny GPT-2 (same name, same shape, other weights): the lens operation and the comparison refuse it
    before any work, naming both weights; the model it was fitted on passes."""
    other = tiny_model("gpt2", "bridge", False, seed=1)
    data = _texts(2)
    for op in (es.Lens(method="jacobian", lens=str(lens_file)), es.LensComparison(lens=str(lens_file))):
        with pytest.raises(EntoscopeError) as err:
            op.plan(other, data)
        assert err.value.code == "jacobian_lens_mismatch" and "other weights" in str(err.value), str(err.value)
        op.plan(get_tiny("gpt2", "bridge", False), data)


def test_the_same_weights_in_another_dtype_are_refused_saying_so(lens_file):
    double = from_hf(tiny_hf_model("gpt2").double(), tiny_tokenizer(), name="tiny-gpt2")
    with pytest.raises(EntoscopeError) as err:
        es.Lens(method="jacobian", lens=str(lens_file)).plan(double, _texts(2))
    assert err.value.code == "jacobian_lens_mismatch" and "float64" in str(err.value) and "float32" in str(err.value)


def test_the_same_checkpoint_through_nnsight_reads_the_plain_bridges_lens(lens_file):
    """Same weights, same (raw) residual basis: the lens passes, and reads the same logits as on the bridge."""
    pytest.importorskip("nnsight")
    nn = from_hf(tiny_hf_model("gpt2"), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    data = _texts(3, seed=4)
    op = es.Lens(method="jacobian", lens=str(lens_file), sites=es.Sites(activation="resid_post", layers=[0]))
    ours = op.run(nn, data, quiet=True).table
    theirs = op.run(get_tiny("gpt2", "bridge", False), data, quiet=True).table
    assert ours["kl_mean"].tolist() == pytest.approx(theirs["kl_mean"].tolist(), rel=1e-4)


@pytest.mark.skipif(not has_hooked_transformer(), reason="transformer-lens 4.x has no HookedTransformer")
def test_a_compat_bridges_lens_reads_a_hooked_transformer_of_the_same_weights(tmp_path):
    """Both hold TransformerLens's folded, centred weights (one fingerprint): the lens passes on the HookedTransformer
    and refuses the plain bridge (raw basis)."""
    compat = get_tiny("gpt2", "bridge", True)
    path = es.JacobianLens.fit(compat, _texts(2), skip_first=1, quiet=True).save(tmp_path / "c.pt")
    es.Lens(method="jacobian", lens=str(path)).plan(get_tiny("gpt2", "hooked", False), _texts(2))
    with pytest.raises(EntoscopeError) as err:
        es.Lens(method="jacobian", lens=str(path)).plan(get_tiny("gpt2", "bridge", False), _texts(2))
    assert err.value.code == "jacobian_lens_mismatch" and "basis" in str(err.value)


def test_a_lens_without_a_fingerprint_is_checked_by_its_model_name(lens_file, tmp_path):
    """A lens written elsewhere (TransformerLens's) records the model's name, not its weights: compared as
    TransformerLens's own validate_model does."""
    def foreign(name):
        def edit(p):
            del p["metadata"]["entoscope_weights"]
            p["metadata"]["model_name"] = name
        return edit
    model = get_tiny("gpt2", "bridge", False)
    es.Lens(method="jacobian", lens=str(_edited(lens_file, tmp_path / "a.pt", foreign("tiny-gpt2")))).plan(
        model, _texts(2))
    with pytest.raises(EntoscopeError) as err:
        es.Lens(method="jacobian", lens=str(_edited(lens_file, tmp_path / "b.pt", foreign("gpt2-xl")))).plan(
            model, _texts(2))
    assert err.value.code == "jacobian_lens_mismatch" and "gpt2-xl" in str(err.value)


# ------------------------------------------------------------------ merging, layers
def test_merging_a_lens_with_itself_is_refused():
    """merge([a, a]) would count a's 2 prompts twice (n_prompts 4); disjoint halves merge (their hashes kept)."""
    model = get_tiny("gpt2", "bridge", False)
    data = _texts(4)
    a = es.JacobianLens.fit(model, data[0:2], skip_first=1, corpus="c", quiet=True)
    b = es.JacobianLens.fit(model, data[2:4], skip_first=1, corpus="c", quiet=True)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLens.merge([a, a])
    assert err.value.code == "jacobian_merge_mismatch" and "2 of its 2 prompts" in str(err.value)
    ab = es.JacobianLens.merge([a, b])
    assert ab.n_prompts == 4
    with pytest.raises(EntoscopeError) as err:  # a merged lens remembers its parts' prompts
        es.JacobianLens.merge([ab, b])
    assert err.value.code == "jacobian_merge_mismatch"
    overlap = es.JacobianLens.fit(model, data[1:3], skip_first=1, corpus="c", quiet=True)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLens.merge([a, overlap])
    assert "1 of its 2 prompts" in str(err.value)


def test_a_merge_of_lenses_without_prompt_hashes_warns(lens_file, tmp_path):
    strip = _edited(lens_file, tmp_path / "s.pt", lambda p: p.pop("prompt_hashes"))
    lens = es.JacobianLens.load(strip)
    with pytest.warns(EntoscopeWarning, match="cannot be checked"):
        merged = es.JacobianLens.merge([lens, es.JacobianLens.load(strip)])
    assert merged.n_prompts == 4 and merged.prompt_hashes is None


def test_an_empty_list_of_layers_is_refused_not_read_as_every_layer():
    model = tiny_model("gpt2", "bridge", False, n_layers=3)
    with pytest.raises(EntoscopeError) as err:
        es.JacobianLensFit(layers=[], skip_first=1).plan(model, _texts(2))
    assert err.value.code == "jacobian_layers"
    assert es.JacobianLensFit(layers=None, skip_first=1).plan(model, _texts(2)).rows == 2  # layers 0 and 1


# ------------------------------------------------------------------ train-lens --corpus
def test_train_lens_fits_on_two_files_merge_when_they_name_one_corpus(tmp_path, capsys):
    from entoscope.cli import main

    texts = ["The capital of France is Paris, and the capital of Spain is Madrid, said the teacher.",
             "When Mary and John went to the store, John gave a drink to Mary at the end of the day.",
             "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."]
    for name, part in (("a.jsonl", texts[:2]), ("b.jsonl", texts[2:])):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in part))
    common = ["train-lens", "--method", "jacobian", "--model", "demo", "--skip-first", "2", "--max-length", "12",
              "--quiet"]
    for part in ("a", "b"):
        assert main([*common, "--data", str(tmp_path / f"{part}.jsonl"), "--corpus", "my-corpus",
                     "--out", str(tmp_path / part)]) == 0
        assert main([*common, "--data", str(tmp_path / f"{part}.jsonl"), "--out", str(tmp_path / f"{part}0")]) == 0
    a, b = es.JacobianLens.load(tmp_path / "a"), es.JacobianLens.load(tmp_path / "b")
    assert a.metadata["corpus"] == b.metadata["corpus"] == "my-corpus"
    merged = es.JacobianLens.merge([a, b])
    assert merged.n_prompts == 3
    expect = (a.jacobians[0].double() * 2 + b.jacobians[0].double()) / 3
    torch.testing.assert_close(merged.jacobians[0].double(), expect, atol=1e-6, rtol=0)
    with pytest.raises(EntoscopeError) as err:  # without --corpus each records its own file's name
        es.JacobianLens.merge([es.JacobianLens.load(tmp_path / "a0"), es.JacobianLens.load(tmp_path / "b0")])
    assert err.value.code == "jacobian_merge_mismatch" and "corpus" in str(err.value)
    assert not math.isnan(merged.jacobians[0].sum().item())
