"""Continuations, steered and unsteered side by side: `tokens` new tokens after some prompts, per condition.

Every (prompt, condition) row grows by one token a step, all rows of a batch in one forward (full
forwards, no key/value cache: continuations are a few prompts of a few tokens). The positions rule
decides which positions are steered (interventions.py): the prompt's (all, last, last:K, listed
positions) and, under all / generated, every generated token's. Greedy takes the most likely token;
sample draws from softmax(logits / temperature) with the Gumbel-max trick, from a generator seeded by
(seed, example, condition), so a row's continuation does not depend on which rows share its batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .runs import BatchRows, SteerSetup


def continue_batch(setup: SteerSetup, batch: BatchRows, rows: list[int], examples: list[int], tokens: int,
                   sample: bool, temperature: float, seed: int, pad: int) -> np.ndarray:
    """[len(rows), C, tokens] int64: the continuations of batch rows `rows` (dataset indices `examples`) under
    every condition (0: unsteered)."""
    C = setup.n_conditions
    out = np.full((len(rows), C, tokens), -1, dtype=np.int64)
    pairs = [(r, j) for j in range(C) for r in range(len(rows))]
    with torch.no_grad():
        for lo in range(0, len(pairs), setup.rows):
            chunk = pairs[lo:lo + setup.rows]
            ex = torch.tensor([rows[r] for r, _ in chunk])
            cond = torch.tensor([j for _, j in chunk])
            plen = batch.lengths[ex]
            buffer = torch.full((len(chunk), int(plen.max()) + tokens), pad, dtype=torch.long)
            given = min(buffer.shape[1], batch.tokens.shape[1])
            buffer[:, :given] = batch.tokens[ex][:, :given]
            gens = [torch.Generator().manual_seed(int(seed) * 1_000_003 + examples[r] * 1009 + j) for r, j in chunk]
            for step in range(tokens):
                cur = plen + step - 1  # each row's last real token
                width = int(cur.max()) + 1
                roles = None if batch.roles is None else batch.roles[ex]
                mask = setup.rule.mask(batch.set_name, cur + 1, roles, width, prompt_lengths=plen)
                logits = setup.model.run(buffer[:, :width], interventions=setup.interventions(cond, mask),
                                         logits_at=cur).logits
                nxt = _choose(logits.float().cpu(), sample, temperature, gens)
                buffer[torch.arange(len(chunk)), cur + 1] = nxt
                out[[r for r, _ in chunk], [j for _, j in chunk], step] = nxt.numpy()
    return out


def _choose(logits: Tensor, sample: bool, temperature: float, gens: list[torch.Generator]) -> Tensor:
    if not sample:
        return logits.argmax(-1)
    noise = torch.stack([torch.rand(logits.shape[-1], generator=g, dtype=torch.float64) for g in gens])
    gumbel = -torch.log(-torch.log(noise.clamp(1e-300, 1 - 1e-16)))
    return (logits.double() / temperature + gumbel).argmax(-1)


def decoded(vocab: list[str], ids: np.ndarray, stop: int | None) -> str:
    """The tokens as text, cut at the first `stop` token (the tokenizer's end of text)."""
    pieces = []
    for i in ids.tolist():
        if i < 0 or (stop is not None and i == stop):
            break
        pieces.append(vocab[i])
    return "".join(pieces)
