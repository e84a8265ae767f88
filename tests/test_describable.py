"""Models entoscope cannot describe are refused before any number is made: a non-causal block, a post-norm
block (checked on block 0 when the model is adapted) and logits that are not unembed(final_norm(last
resid_post)) (checked on the first forward entoscope makes, or before the unembedding is first read).

Each tampered model is made from a tiny decoder that passes every check (its plain run is the control),
by a forward hook that breaks exactly one property; an in-place no-op edit of a weight then makes the
weights a version entoscope has not checked.
"""

from __future__ import annotations


import pytest
import torch

import entoscope as es
from entoscope.errors import UnsupportedModelError
from entoscope.models.adapter import adapt, module_of
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

from conftest import has_hooked_transformer
from extras import require

PROMPTS = ["one two three four five", "When Mary and John went to the store"]
KINDS = ["bridge", "nnsight"] + (["hooked"] if has_hooked_transformer() else [])


def _model(kind: str):
    if kind == "nnsight":
        require("nnsight")
        return from_hf(tiny_hf_model("gpt2"), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    return tiny_model("gpt2", backend=kind)


def _unseen(model) -> None:
    """An in-place edit that changes no value: the weights are a version entoscope has not checked."""
    with torch.no_grad():
        next(module_of(model).parameters()).mul_(1.0)


def _tamper(model, where: str, fn) -> None:
    """Make a TransformerLens model's `where` ("block0": block 0's output, as its resid_post hook sees it;
    "logits") return fn(value)."""
    m = module_of(model)
    if where == "block0":
        m.blocks[0].hook_resid_post.add_hook(lambda x, hook: fn(x), is_permanent=True)
    else:
        m.unembed.register_forward_hook(lambda mod, i, out: fn(out))
    _unseen(model)


def _broken_block(kind: str, fn):
    """A model whose block 0 returns fn(its output). nnsight reads a module's output past any hook, so there
    the block's class is changed, in an nnsight LanguageModel built directly, as a user would."""
    if kind != "nnsight":
        model = _model(kind)
        _tamper(model, "block0", fn)
        return model
    from nnsight import LanguageModel

    hf = tiny_hf_model("gpt2")
    block = hf.transformer.h[0]

    class Broken(type(block)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)

    block.__class__ = Broken
    return LanguageModel(hf, tokenizer=tiny_tokenizer())


class _ScaledNorm(torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.5 * super().forward(x)


def _broken_logits(kind: str, model):
    """`model` with logits that are not unembed(final_norm(last resid_post)). TransformerLens: the logits
    soft-capped after the unembedding, as Gemma 2 does, with nothing in the model saying so. nnsight reads
    the unembedding's own output past any hook, so there the final norm's forward scales its output (its
    weights unchanged), in an nnsight LanguageModel built directly, as a user would."""
    if kind != "nnsight":
        _tamper(model, "logits", lambda x: 3.0 * torch.tanh(x / 3.0))
        return model
    from nnsight import LanguageModel

    hf = tiny_hf_model("gpt2")
    hf.transformer.ln_f.__class__ = _ScaledNorm
    return LanguageModel(hf, tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["lens", "dla", "parameter_lens", "probing"])
def test_logits_that_are_not_the_unembedded_residual_are_refused(kind, op):
    """The first forward with logits (lens, DLA), a weights-only read of W_U (parameter lens) or a first
    forward without logits (probing) each meet the check before a number is returned."""
    model = _model(kind)
    if op == "dla":
        data = es.data.Dataset("p", tuple(es.data.Example(p, answers=(11,)) for p in PROMPTS))
    else:
        data = es.data.Dataset("p", tuple(es.data.Example(p, label=i % 2) for i, p in enumerate(PROMPTS * 4)))
    operation = {"lens": es.Lens(), "dla": es.DirectLogitAttribution(metric="logit"),
                 "parameter_lens": es.ParameterLens(), "probing": es.Probing()}[op]

    def run():
        return operation.run(model, quiet=True) if op == "parameter_lens" else operation.run(model, data, quiet=True)

    run()  # the control: the untampered model passes
    model = _broken_logits(kind, model)
    for call in (lambda: operation.plan(model) if op == "parameter_lens" else operation.plan(model, data), run):
        with pytest.raises(UnsupportedModelError) as err:  # plan (it makes every check run makes), then run
            call()
        assert err.value.code == "not_a_decoder" and "unembed(final_norm(last resid_post)) is not" in err.value.message


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_that_is_not_causal_or_not_additive_is_refused_when_adapted(kind):
    model = _model(kind)
    adapt(model)  # the control
    # every position of block 0's output gets the mean over positions: later tokens reach earlier ones
    with pytest.raises(UnsupportedModelError) as err:
        adapt(_broken_block(kind, lambda x: x + x.mean(1, keepdim=True)))
    assert err.value.code == "not_a_decoder" and "not causal" in err.value.message
    # block 0's output normalised (a post-norm block): resid_post is not the sum of what was added
    with pytest.raises(UnsupportedModelError) as err:
        adapt(_broken_block(kind, lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:])))
    assert err.value.code == "not_a_decoder" and "not additive" in err.value.message


def test_a_capped_model_is_refused_at_load():
    hf = tiny_hf_model("gpt2")
    hf.lm_head.register_forward_hook(lambda m, i, out: 3.0 * torch.tanh(out / 3.0))
    with pytest.raises(UnsupportedModelError) as err:
        from_hf(hf, tiny_tokenizer(), name="tiny-gpt2")  # a bridge
    assert err.value.code == "not_a_decoder"


def test_a_scaled_final_norm_is_refused_at_load_on_nnsight():
    require("nnsight")
    hf = tiny_hf_model("gpt2")
    hf.transformer.ln_f.__class__ = _ScaledNorm
    with pytest.raises(UnsupportedModelError) as err:
        from_hf(hf, tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    assert err.value.code == "not_a_decoder"
