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
