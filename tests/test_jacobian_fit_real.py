"""The Jacobian lens fit's savings on the real models (the `real` marker): every RMS norm of SmolLM2-135M and Gemma 3
270M, folded (lens/normfold.py), against autograd of the module's own forward on the model's own activations; and
the fitted matrices against TransformerLens 4.3's `JacobianLens.fit` on the same texts, layers and positions
(where transformer-lens has it; 3.9 has none), with the closed-form norms and (SmolLM2) the suffix graph in use."""

from __future__ import annotations

import pytest
import torch

import entoscope as es
from entoscope.lens import normfold
from entoscope.models.adapter import adapt
from entoscope.models.partial import prefix_support

from test_jacobian_fit_paths import check_norms_against_their_own_autograd

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_model(real_folder):
    return es.load_model(real_folder)


def test_every_rms_norm_of_a_real_model_folds_to_its_own_backward(real_model):
    a = adapt(real_model)
    ids = a.tokenize(es.tasks.get("corpus", n=1, seed=2)[0].prompt)[:24]
    folded = check_norms_against_their_own_autograd(real_model, ids)
    assert folded >= 2 * a.structure.n_layers + 1  # two per block and the final one at least (Gemma 3: more)


def test_the_fit_equals_transformer_lens_on_a_real_model(real_model, real_folder, monkeypatch):
    analysis = pytest.importorskip("transformer_lens.tools.analysis")
    if not hasattr(analysis, "JacobianLens"):
        pytest.skip("this transformer-lens has no JacobianLens (4.3 has)")
    checks: list[bool] = []
    check = normfold._Folder.check

    def recorded(self, x):
        checks.append(check(self, x))
        return checks[-1]

    monkeypatch.setattr(normfold._Folder, "check", recorded)
    a = adapt(real_model)
    L = a.structure.n_layers
    texts = [ex.prompt for ex in es.tasks.get("corpus", n=2, seed=4)]
    layers, skip, length = [L - 4, L - 2], 6, 20
    ours = es.JacobianLens.fit(real_model, texts, layers=layers, skip_first=skip, max_length=length, corpus="c",
                               quiet=True)
    theirs = analysis.JacobianLens.fit(real_model, texts, corpus="c", source_layers=layers, max_seq_len=length,
                                       skip_first_positions=skip, show_progress=False)
    # the closed form was checked against each norm's own autograd and taken, on every norm the graph runs through
    assert checks and all(checks)
    if "smollm2" in str(real_folder):
        assert prefix_support(a) == "positions"  # SmolLM2's graph holds positions skip_first.. only
    assert ours.source_layers == theirs.source_layers == layers and ours.n_prompts == theirs.n_prompts == 2
    for layer in layers:  # float32 summation order only
        want = theirs.jacobians[layer]
        torch.testing.assert_close(ours.jacobians[layer], want, atol=1e-4 * max(1.0, float(want.abs().max())),
                                   rtol=1e-4)
