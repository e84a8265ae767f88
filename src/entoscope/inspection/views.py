"""What `es.inspect` reads from one run of one prompt: the model's predictions, the lens grids, every head's
attention pattern and the direct logit attribution at the last position. Each is a tidy table; the maths is
the project's own (lens/project.py decodes a residual state, circuits/dla.py attributes), so each view
equals the operation it comes from on the same prompt (tests/test_inspect.py checks it).

Conventions:
  probabilities   softmax of the logits (the model's own for `predictions`; the lens's for the grids)
  rank            how many tokens have a larger logit (0 = the top token), as the lens operation counts it
  kl_to_final     KL(the model's final distribution || the lens distribution) at that position, in nats
  attention       pattern[head, query, key] of layer L: softmax over keys of that head's scores (after the
                  causal mask, soft caps and sliding windows); only key <= query is kept (the rest is 0)
  DLA             circuits/dla.py: each component's direct contribution through the final norm with its scale
                  frozen at this run (Elhage et al. 2021; TransformerLens's apply_ln_to_stack), the
                  `constant` row (final norm bias and b_U) added so that the rows sum to the model's own
                  logit difference (or the answer's logit without a wrong answer)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .. import naming
from ..circuits.decompose import components, decomposition_reads
from ..circuits.dla import attribute, check_identity, default_tolerance, value_rounding
from ..lens.project import decode_states
from ..models.adapter import ModelAdapter
from ..models.names import ActName
from ..models.vocabulary import Vocabulary

LENS_BUDGET = 1 << 24  # floats of [layers, positions, vocab] decoded at once (64 MB)


def _top(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    top_lp, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return top_i, top_lp.exp()


def _with_top(frame: dict[str, Any], vocab: Vocabulary, top_i: Tensor, top_p: Tensor) -> None:
    for t in range(top_i.shape[-1]):
        frame[f"top{t + 1}_token"] = list(vocab.take(top_i[..., t].reshape(-1).numpy()))
        frame[f"top{t + 1}_prob"] = top_p[..., t].reshape(-1).double().numpy()


def rank_of(logits: Tensor, ids: Tensor) -> Tensor:
    """[..., n] how many tokens have a larger logit than each id's (0 = the top token): logits [..., V]."""
    chosen = logits.gather(-1, ids.expand(*logits.shape[:-1], ids.shape[-1]))
    return (logits[..., None, :] > chosen[..., None]).sum(-1, dtype=torch.int32)


def predictions_table(vocab: Vocabulary, tokens: Sequence[int], logits: Tensor, k: int,
                      answers: Sequence[int] | None, wrong: Sequence[int] | None) -> pd.DataFrame:
    """One row per position: its token and the model's top k next tokens with their probabilities; at the
    last position, with answers, the first answer's rank, probability and logit (and the first wrong answer's,
    and `logit_diff`: mean logit of the answers minus mean logit of the wrong ones, the DLA metric)."""
    logits = logits.float().cpu()
    logp = logits.log_softmax(-1)
    top_i, top_p = _top(logp, k)
    T = len(tokens)
    frame: dict[str, Any] = {"position": np.arange(T), "token": list(vocab.take(list(tokens))),
                             "token_id": np.asarray(tokens, dtype=np.int64)}
    _with_top(frame, vocab, top_i, top_p)
    table = pd.DataFrame(frame)
    for name, ids in (("answer", answers), ("wrong", wrong)):
        if not ids:
            continue
        first = torch.tensor([ids[0]])
        table[name] = [None] * (T - 1) + [vocab[ids[0]]]
        table[f"{name}_rank"] = pd.array([None] * (T - 1) + [int(rank_of(logits[-1], first)[0])], dtype="Int64")
        table[f"{name}_prob"] = [np.nan] * (T - 1) + [float(logp[-1, ids[0]].exp())]
        table[f"{name}_logit"] = [np.nan] * (T - 1) + [float(logits[-1, ids[0]])]
    if answers and wrong:
        last = logits[-1].double()
        diff = float(last[list(answers)].mean() - last[list(wrong)].mean())
        table["logit_diff"] = [np.nan] * (T - 1) + [diff]
    return table


def lens_table(model: ModelAdapter, name: str, states: dict[int, Tensor], final_logits: Tensor, tokens: Sequence[int],
               k: int, answer: int | None, transform: Callable[[Tensor, int], Tensor] | None = None) -> pd.DataFrame:
    """The lens grid of one lens, one row per (layer, position): layer L's resid_post decoded as the lens
    operation decodes it (`transform`: a tuned or Jacobian lens's map of layer L, none for the logit lens),
    its top k tokens and probabilities, KL to the model's output and, with an answer, the answer's rank,
    probability and logit. `states[L]` is resid_post.L [T, d_model]; layers missing from it have no row."""
    vocab = model.vocab_strings()
    layers = sorted(states)
    T, V = len(tokens), model.structure.d_vocab
    final = final_logits.float()
    final_lse = torch.logsumexp(final, -1)  # [T]
    final_p = (final - final_lse[:, None]).exp()
    chunk = max(1, LENS_BUDGET // max(1, T * V))
    parts: list[dict[str, Any]] = []
    with torch.no_grad():
        for start in range(0, len(layers), chunk):
            group = layers[start:start + chunk]
            vec = torch.stack([states[L] if transform is None else transform(states[L], L) for L in group])
            logits = decode_states(model, vec).float()  # [c, T, V]
            lse = torch.logsumexp(logits, -1)  # [c, T]: probabilities are exp(logit - lse), no [c, T, V] softmax
            top_v, top_i = logits.topk(min(k, V), dim=-1)
            part: dict[str, Any] = {"layer": np.repeat(group, T), "position": np.tile(np.arange(T), len(group))}
            # KL(final || lens) = sum_v p_v (final_v - logit_v) + lse - final_lse (logits, not log-probabilities:
            # the difference is small where the lens agrees with the output, so nothing cancels)
            kl = torch.einsum("ltv,tv->lt", final[None] - logits, final_p) + lse - final_lse[None]
            part["kl_to_final"] = kl.reshape(-1).double().cpu().numpy()
            part["top_i"] = top_i.reshape(-1, top_i.shape[-1]).cpu()
            part["top_p"] = (top_v - lse[..., None]).exp().reshape(-1, top_i.shape[-1]).cpu()
            if answer is not None:
                chosen = logits[..., answer]
                part["answer_rank"] = (logits > chosen[..., None]).sum(-1, dtype=torch.int32).reshape(-1).cpu().numpy()
                part["answer_prob"] = (chosen - lse).exp().reshape(-1).double().cpu().numpy()
                part["answer_logit"] = chosen.reshape(-1).double().cpu().numpy()
            parts.append(part)
    if not parts:
        return pd.DataFrame()
    layer = np.concatenate([p["layer"] for p in parts])
    position = np.concatenate([p["position"] for p in parts])
    token_text = vocab.take(list(tokens))
    frame: dict[str, Any] = {"lens": name, "site": [naming.site("resid_post", {"layer": int(L), "pos": int(p)})
                                                   for L, p in zip(layer, position)],
                             "layer": layer.astype(np.int64), "position": position.astype(np.int64),
                             "token": list(token_text[position])}
    _with_top(frame, vocab, torch.cat([p["top_i"] for p in parts]), torch.cat([p["top_p"] for p in parts]))
    frame["kl_to_final"] = np.concatenate([p["kl_to_final"] for p in parts])
    if answer is not None:
        frame["answer"] = vocab[answer]
        frame["answer_rank"] = np.concatenate([p["answer_rank"] for p in parts]).astype(np.int64)
        frame["answer_prob"] = np.concatenate([p["answer_prob"] for p in parts])
        frame["answer_logit"] = np.concatenate([p["answer_logit"] for p in parts])
    return pd.DataFrame(frame)


def attention_table(patterns: dict[int, Tensor]) -> pd.DataFrame:
    """One row per (layer, head, query position, key position <= query): the head's attention weight."""
    parts = []
    for L in sorted(patterns):
        p = patterns[L].float().cpu()  # [H, T, T]
        H, T, _ = p.shape
        q, key = np.tril_indices(T)
        weights = p.numpy()[:, q, key]  # [H, T(T+1)/2]
        parts.append(pd.DataFrame({"layer": np.full(H * len(q), L, dtype=np.int64),
                                   "head": np.repeat(np.arange(H, dtype=np.int64), len(q)),
                                   "query_pos": np.tile(q, H).astype(np.int64),
                                   "key_pos": np.tile(key, H).astype(np.int64),
                                   "weight": weights.reshape(-1).astype(np.float64)}))
    return pd.concat(parts, ignore_index=True)


def dla_reads(model: ModelAdapter) -> list[ActName]:
    """What the attribution reads from the run (every component's output, the final norm's scale)."""
    return decomposition_reads(model.structure) + [ActName("final_scale")]


def dla_table(model: ModelAdapter, acts: dict[ActName, Tensor], logits: Tensor, answers: Sequence[int],
              wrong: Sequence[int] | None) -> tuple[pd.DataFrame, dict[str, float]]:
    """Every component's direct contribution at the last position (circuits/dla.py), and a `constant` row, so
    that the rows sum to the model's own metric; and the identity's terms (checked: `dla_identity_failed`)."""
    T = logits.shape[1]
    last = torch.tensor([T - 1])
    ans = torch.tensor([list(answers)])
    wr = None if not wrong else torch.tensor([list(wrong)])
    with torch.no_grad():
        rows, constant, value = attribute(model, acts, logits, last, ans, wr)
    metric = "logit_diff" if wrong else "logit"
    ident = {"value": value.cpu(), "constant": constant.cpu(), "sum": rows.sum(0).cpu(),
             "rounding": value_rounding(logits, last, ans, wr).cpu()}
    check_identity(ident, default_tolerance(model.unembedding_dtype), metric)
    comps = components(model.structure)
    frame = pd.DataFrame({
        "component": [c.label for c in comps] + ["constant"],
        "kind": [c.kind for c in comps] + ["constant"],
        "layer": pd.array([c.layer for c in comps] + [None], dtype="Int64"),
        "head": pd.array([c.head for c in comps] + [None], dtype="Int64"),
        "contribution": np.append(rows[:, 0].double().cpu().numpy(), float(constant[0])),
    })
    terms = {"metric": metric, "value": float(value[0]), "sum_of_rows": float(rows[:, 0].sum()),
             "constant": float(constant[0])}
    return frame, terms
