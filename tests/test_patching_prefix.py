"""Exact patching of pairs whose prompts share a prefix, against brute-force patching written here with plain
torch hooks on the HuggingFace model (a full forward per prompt and site, no entoscope and no TransformerLens).

With patch: source, nothing changes before the first token where a pair's prompts differ, so exact patching
starts a head's all-position patch there and runs no row that patches only earlier positions (its value is
the base run's metric). The numbers must not move: every model kind, heads over every position and a
resid_pre layer x position sweep, pairs sharing 1, 4 and all-but-one tokens, mixed lengths."""

import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.models import adapt
from entoscope.models.loading import from_hf
from entoscope.models.tiny import tiny_hf_model, tiny_tokenizer, tokenizer_dir
from entoscope.patching import Patching

from conftest import has_hooked_transformer

KINDS = [("gpt2", "bridge"), ("gpt2", "compat"), ("gpt2", "cached"), ("llama", "bridge"), ("llama", "compat")] + \
    ([("gpt2", "hooked"), ("llama", "hooked")] if has_hooked_transformer() else []) + [("gpt2", "nnsight")]
SEED = 3
POSITIONS = [0, 2, 4, -2, -1]


def shared_prefix_pairs() -> Dataset:
    """Pairs of random ids (BOS 0 first): three share 4 tokens, one only BOS, one all but its last token."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i, (T, shared) in enumerate([(7, 4), (9, 4), (8, 4), (8, 1), (9, 8)]):
        clean = [0] + torch.randint(1, 300, (T - 1,), generator=g).tolist()
        corrupt = clean[:shared] + torch.randint(1, 300, (T - shared,), generator=g).tolist()
        assert corrupt[shared] != clean[shared]
        out.append(Example(tuple(clean), tuple(corrupt), answers=(5 + i,), wrong_answers=(40 + i,)))
    return Dataset("shared-prefix", tuple(out))


def build(family: str, kind: str):
    hf = tiny_hf_model(family, seed=SEED)
    backend = {"compat": "bridge", "cached": "bridge"}.get(kind, kind)
    model = from_hf(hf, tiny_tokenizer(), backend=backend, compat=kind == "compat", name=f"tiny-{family}",
                    folder=tokenizer_dir())
    if kind == "cached":
        import tempfile
        model = es.CachedModel(model, cache_dir=tempfile.mkdtemp(prefix="entoscope-prefix-test-"))
    return model


# ---------------------------------------------------------------------- brute force on the HuggingFace model
def _blocks(hf):
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _out_proj(hf, layer):
    block = _blocks(hf)[layer]
    return block.attn.c_proj if hasattr(block, "attn") else block.self_attn.o_proj


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args, kwargs, h):
    return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})


def _record(hf, tokens):
    """The residual entering each block and each attention's output-projection input (heads' z), [L][1, T, d]."""
    resid, z, handles = {}, {}, []
    for L, block in enumerate(_blocks(hf)):
        handles.append(block.register_forward_pre_hook(
            lambda m, a, kw, L=L: resid.__setitem__(L, _hidden(a, kw).detach().clone()), with_kwargs=True))
        handles.append(_out_proj(hf, L).register_forward_pre_hook(
            lambda m, a, L=L: z.__setitem__(L, a[0].detach().clone())))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()
    return resid, z


def _logit_diff(hf, tokens, module, hook, ans, wrong, kwargs=False):
    handle = module.register_forward_pre_hook(hook, with_kwargs=kwargs)
    try:
        with torch.no_grad():
            logits = hf(tokens).logits[0, -1]
    finally:
        handle.remove()
    return float(logits[ans] - logits[wrong])


def brute_force(family: str, data: Dataset):
    """({(example, layer, head): patched logit diff}, {(example, layer, position): ...}), denoising."""
    hf = tiny_hf_model(family, seed=SEED)
    n_heads = hf.config.num_attention_heads if hasattr(hf.config, "num_attention_heads") else hf.config.n_head
    d_head = hf.config.hidden_size // n_heads
    heads, resid = {}, {}
    for e, ex in enumerate(data):
        clean, corrupt = torch.tensor([ex.prompt]), torch.tensor([ex.counterfactual])
        T, ans, wrong = clean.shape[1], ex.answers[0], ex.wrong_answers[0]
        clean_resid, clean_z = _record(hf, clean)
        for L in range(len(_blocks(hf))):
            for h in range(n_heads):
                cols = slice(h * d_head, (h + 1) * d_head)

                def put_head(m, a, L=L, cols=cols):
                    z = a[0].clone()
                    z[..., cols] = clean_z[L][..., cols]
                    return (z,)
                heads[e, L, h] = _logit_diff(hf, corrupt, _out_proj(hf, L), put_head, ans, wrong)
            for p in POSITIONS:
                p = p % T

                def put_resid(m, a, kw, L=L, p=p):
                    x = _hidden(a, kw).clone()
                    x[:, p] = clean_resid[L][:, p]
                    return _with_hidden(a, kw, x)
                resid[e, L, p] = _logit_diff(hf, corrupt, _blocks(hf)[L], put_resid, ans, wrong, kwargs=True)
    return heads, resid


_BRUTE: dict = {}


@pytest.mark.parametrize("family, kind", KINDS, ids=lambda v: v)
def test_shared_prefix_cuts_equal_brute_force_patching(family, kind):
    data = shared_prefix_pairs()
    if family not in _BRUTE:
        _BRUTE[family] = brute_force(family, data)
    heads, resid = _BRUTE[family]
    model = build(family, kind)
    op = Patching(sites=es.Sites(activation="z", over=["layer", "head"]), comparison="absolute", batch_size=6)
    prepared = op.prepare(adapt(model), data)
    if prepared.state.setup.path == "positions":  # the cut is taken: no head row starts before position 1
        assert min(b.position for sch in prepared.state.schedules for b in sch) >= 1
    pp = op.run(model, data, quiet=True).per_prompt
    assert len(pp) == len(heads)
    for row in pp.itertuples():
        expected = heads[row.example, row.layer, row.head]
        assert abs(row.patched_metric - expected) <= 2e-5 * max(1.0, abs(expected)), (row, expected)

    op = Patching(sites=es.Sites(activation="resid_pre", over=["layer", "position"], positions=POSITIONS),
                  comparison="absolute", batch_size=6)
    plan = op.plan(model, data)
    # rows at positions before the first difference run nowhere: positions 0 and 2 of the three pairs that
    # share 4 tokens, position 0 of the others, and every position but the last of the pair sharing 8
    same = 2 * (3 * 2 + 1 + 4)  # 2 layers x rows before the first differing token
    assert f"{same} of {2 * len(data) * len(POSITIONS)} patched rows write only positions before" in str(plan)
    pp = op.run(model, data, quiet=True).per_prompt
    assert len(pp) == len(resid)
    for row in pp.itertuples():
        expected = resid[row.example, row.layer, row.token_position]
        assert abs(row.patched_metric - expected) <= 2e-5 * max(1.0, abs(expected)), (row, expected)
