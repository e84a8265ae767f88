"""es.Interchange on SmolLM2-135M (a real Llama-family model) against plain transformers: the whole-vector
interchange at resid_post of layer L at the END token is, per pair, a forward hook on model.model.layers[L]
that writes the source run's hidden state at its last token into the base run's last token. The hand-written
hook's logits give, pair by pair, whether the prediction (the base's subject, IOI's swapped IO) wins over
the base's IO: their share must be the operation's IIA. A fixed basis (PCA) runs beside it at two sites.
Measured (8 held-out pairs): 0/8 at layer 16 (the names have not reached the last token) and 8/8 at layer 26,
the same by hook and by the operation; about 20 s on the shared 2-core machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.interchange.causal import build_pairs, split

pytestmark = pytest.mark.real

LAYERS = (16, 26)


def test_full_interchange_equals_a_transformers_hook_on_smollm2(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    data = es.tasks.ioi(n=8, seed=1, tokenizer=tok)
    op = es.Interchange(layers=list(LAYERS), positions=["END"], bases=["pca"], rank=2, placebo=False, seed=0)
    table = op.run(es.load_model(str(smollm2_folder)), data, quiet=True).table.set_index(["site", "basis"])
    pairs = build_pairs(data, None)
    held = np.flatnonzero(split(pairs, op.test_share, op.seed))

    def ids(text: str) -> torch.Tensor:  # the operation prepends BOS (prepend_bos: true)
        return torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]])

    def hidden_after(layer: int, text: str) -> torch.Tensor:  # the output of decoder layer `layer`
        with torch.no_grad():
            return hf(ids(text), output_hidden_states=True).hidden_states[layer + 1][0, -1]

    for layer in LAYERS:
        hits = 0
        for k in held:
            base = pairs.prompts[int(pairs.base[k])].prompt
            source = hidden_after(layer, pairs.prompts[int(pairs.source[k])].prompt)

            def copy(module, args, output, source=source):
                hs = output[0] if isinstance(output, tuple) else output
                hs = hs.clone()
                hs[0, -1] = source
                return (hs, *output[1:]) if isinstance(output, tuple) else hs

            handle = hf.model.layers[layer].register_forward_hook(copy)
            try:
                with torch.no_grad():
                    logits = hf(ids(base)).logits[0, -1]
            finally:
                handle.remove()
            io, s = (tok(c, add_special_tokens=False).input_ids[0] for c in pairs.classes[k])
            hits += int(logits[s] > logits[io])  # the prediction under the interchange: the base's subject
        row = table.loc[(f"resid_post.{layer}@END", "full")]
        assert row["n_pairs"] == len(held) == 8
        assert row["iia"] == hits / len(held), (layer, row["iia"], hits)
        assert table.loc[(f"resid_post.{layer}@END", "pca"), "rank"] <= 2


def test_induction_full_interchange_at_the_copied_token_equals_a_transformers_hook(smollm2_folder):
    """Induction's variable (the token to copy) on SmolLM2: the whole vector at resid_post.L@B1 written by a hook
    on model.model.layers[L] at the one token where base and source differ (what follows the current token's
    first occurrence); the share of held-out pairs whose hooked run prefers the source's token is the IIA.
    Measured (6 held-out pairs): 6/6 at layer 4, both ways (at END of layer 4: 0/6, the copy has not started)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    data = es.tasks.induction(n=6, seed=0, tokenizer=tok)
    layer = 4
    op = es.Interchange(variable="token", layers=[layer], positions=["B1"], bases=["pca"], rank=2, placebo=False,
                        seed=0)
    table = op.run(es.load_model(str(smollm2_folder)), data, quiet=True).table.set_index(["site", "basis"])
    pairs = build_pairs(data, "token")
    held = np.flatnonzero(split(pairs, op.test_share, op.seed))

    def ids(text: str) -> torch.Tensor:
        return torch.tensor([[tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]])

    hits = 0
    for k in held:
        base, source = ids(pairs.prompts[int(pairs.base[k])].prompt), ids(pairs.prompts[int(pairs.source[k])].prompt)
        at = int((base[0] != source[0]).nonzero()[0, 0])
        with torch.no_grad():
            vec = hf(source, output_hidden_states=True).hidden_states[layer + 1][0, at]

        def copy(module, args, output, vec=vec, at=at):
            hs = (output[0] if isinstance(output, tuple) else output).clone()
            hs[0, at] = vec
            return (hs, *output[1:]) if isinstance(output, tuple) else hs

        handle = hf.model.layers[layer].register_forward_hook(copy)
        try:
            with torch.no_grad():
                logits = hf(base).logits[0, -1]
        finally:
            handle.remove()
        mine, theirs = (tok(c, add_special_tokens=False).input_ids[0] for c in pairs.classes[k])
        hits += int(logits[theirs] > logits[mine])
    row = table.loc[(f"resid_post.{layer}@B1", "full")]
    assert row["n_pairs"] == len(held) and row["iia"] == hits / len(held), (row["iia"], hits)
