"""How well a model does the built-in tasks (the `entoscope info` and report figures).

  ioi           accuracy = share of prompts whose answer logit beats the wrong name's;
                logit_diff = mean of (answer logit - wrong logit)
  facts         accuracy = share of prompts whose top-1 next token is the capital
  greater_than  prob_diff = mean of (P(years > start) - P(years <= start)) (Hanna et al. 2023)
  induction     accuracy = share of prompts whose top-1 next token continues the repeat

Every number is read at each prompt's last token, in batches, through the model layer. An answer is read
by its first token (answer_scoring first_token, data/tokenized.py: what the operations read). Where a
task's answers are several tokens under the model's tokenizer (greater-than's years on a digit tokenizer,
a name split in two), the whole answers are read as well, by teacher forcing (`<key>_sequence`): each
answer's log-probability is the sum of its tokens' log-probabilities, each read after the prompt and the
answer's earlier tokens (one forward of prompt + answer[:-1]; rows sharing a prefix share the forward).
Then logit_diff is the mean answer log-probability minus the mean wrong one (for one-token answers exactly
the logit difference: the softmax's normaliser cancels), and a top-1 accuracy asks that every token of the
answer be the top token (greedy decoding gives the answer). prob_diff, the probability of a set of answers,
sums the probabilities of the set's deciding prefixes: the shortest prefixes after which every answer
listed lies in that set (`deciding_prefixes`). Greater-than on a digit tokenizer, start year 32:
P(years > 32) = P(4..9) + P(3) P(3..9 | 3), P(years <= 32) = P(0..2) + P(3) P(0..2 | 3) (a start year
ending in 9 puts its decade's digit whole with the wrong years), the probability mass on valid first digits
and then second digits, in one forward of prompt + "3" (the decade's digit).

Intervals (95%): an accuracy, a share of prompts, gets the Wilson interval (stats/proportion.py; the
bootstrap's is degenerate at 0 and n of n); a mean (logit_diff, prob_diff) the bootstrap over prompts.
A verdict says which tasks the model does well and badly, from the interval alone: "does well" when its low
end is at or above the bar (accuracy 0.8, prob_diff 0.5), "does badly" when its high end is below the
floor (accuracy 0.5, prob_diff 0.1), "in part" otherwise; a task with answers of several tokens is judged
on its sequence reading.
"""

from __future__ import annotations

from typing import Any

import torch

from .data import tasks
from .data.tokenized import TokenizedData, length_batches, make_batches, pad, pad_id, tokenize_data
from .metrics import logit_diff, prob_diff, top1
from .models.adapter import adapt
from .models.names import ActName
from .models.partial import unembed_rows


TASK_METRICS = {"ioi": "logit_diff", "facts": "top1", "greater_than": "prob_diff", "induction": "top1"}
_METRIC_FUNCTIONS = {"logit_diff": logit_diff, "prob_diff": prob_diff, "top1": top1}
VERDICT_BARS = {"accuracy": (0.8, 0.5), "prob_diff": (0.5, 0.1)}  # (does well: low >= , does badly: high <)
LEVEL = 0.95


def task_scores(model: Any, n: int = 64, seed: int = 1234, batch_size: int = 32) -> dict[str, dict[str, Any]]:
    """Accuracy-style figures on `n` fresh prompts of each task (seeded), each read with its metric in
    TASK_METRICS (the metric steering's task-score side effects use too), with the verdict."""
    a = adapt(model)
    out: dict[str, dict[str, Any]] = {}
    for name, metric in TASK_METRICS.items():
        try:
            data = tasks.get(name, n=n, seed=seed, tokenizer=a.tokenizer)
            td = tokenize_data(a, data, answers=True, answer_scoring="sequence")  # read both ways below
        except ValueError as err:  # the tokenizer lacks the task's words (or first tokens that tell them apart)
            out[name] = {"skipped": 1.0, "reason": str(err)}
            continue
        parts: list[torch.Tensor] = []
        with torch.no_grad():
            for b in make_batches(td, batch_size, pad_id(a)):
                logits = a.run(b.tokens, logits_at=b.last).logits  # [B, d_vocab]: the last tokens' rows only
                assert b.answers is not None and b.wrong_answers is not None
                parts.append(_METRIC_FUNCTIONS[metric](logits, b.answers, b.wrong_answers))
        figs = _figures(metric, torch.cat(parts), "")
        if _several_tokens(td):
            try:
                figs.update(_figures(metric, sequence_metric(a, td, metric, batch_size), "_sequence"))
            except ValueError as err:  # an answer is how one of the other set starts (no prefix decides it)
                figs["sequence_skipped"] = str(err)  # type: ignore[assignment]
        out[name] = {**figs, "n": float(len(td)), **verdict(figs)}
    return out


def _figures(metric: str, values: torch.Tensor, suffix: str) -> dict[str, float]:
    if metric == "logit_diff":
        return {**_share_ci("accuracy" + suffix, values > 0), **_mean_ci("logit_diff" + suffix, values)}
    if metric == "prob_diff":
        return _mean_ci("prob_diff" + suffix, values)
    return _share_ci("accuracy" + suffix, values > 0.5)


def _several_tokens(td: TokenizedData) -> bool:
    return any(len(s) > 1 for rows in (td.answer_seqs or []) + (td.wrong_seqs or []) for s in rows)


def verdict(figs: dict[str, float]) -> dict[str, str]:
    """Which the model does: well, badly or in part, from the interval of the task's main figure."""
    for key, (good, bad) in VERDICT_BARS.items():
        for k in (key + "_sequence", key):
            if k in figs:
                low, high = figs[k + "_ci_low"], figs[k + "_ci_high"]
                where = f"{k.replace('_', ' ')} {figs[k]:.3f} [{low:.3f}, {high:.3f}]"
                if low >= good:
                    return {"verdict": "does well", "why": f"{where}: its interval is at or above {good:g}"}
                if high < bad:
                    return {"verdict": "does badly", "why": f"{where}: its interval is below {bad:g}"}
                return {"verdict": "in part", "why": f"{where}: its interval is neither at or above {good:g} nor "
                        f"below {bad:g}"}
    return {}


def teacher_forced(model: Any, prompts: list[list[int]], seqs: list[list[tuple[int, ...]]], batch_size: int = 32
                   ) -> tuple[list[list[float]], list[list[bool]]]:
    """Teacher forcing: for each prompt, the log-probability of each of its token sequences after it (the sum
    over the sequence's tokens, each read after the prompt and the sequence's earlier tokens), and whether
    each of its tokens was the top token. One row is prompt + a sequence's tokens but its last; a row serves
    every sequence whose earlier tokens are a prefix of it (a causal model's logits at a position do not
    depend on later tokens), so answers sharing first tokens share a forward."""
    a = adapt(model)
    rows: list[list[int]] = []
    reads: list[tuple[int, int, int]] = []  # (row, position, token)
    where: list[list[list[int]]] = []  # per prompt, per sequence: its indices into reads
    for prompt, mine_seqs in zip(prompts, seqs):
        mine: list[tuple[tuple[int, ...], int]] = []  # (tokens after the prompt, row) of this prompt
        for s in sorted({q[:-1] for q in mine_seqs}, key=len, reverse=True):
            if not any(ext[:len(s)] == s for ext, _ in mine):
                mine.append((s, len(rows)))
                rows.append(list(prompt) + list(s))
        per: list[list[int]] = []
        for q in mine_seqs:
            row = next(r for ext, r in mine if ext[:len(q) - 1] == q[:-1])
            per.append([len(reads) + j for j in range(len(q))])
            reads += [(row, len(prompt) - 1 + j, q[j]) for j in range(len(q))]
        where.append(per)
    logp = torch.empty(len(reads), dtype=torch.float64)
    greedy = torch.empty(len(reads), dtype=torch.bool)
    by_row: dict[int, list[int]] = {}
    for k, (r, _, _) in enumerate(reads):
        by_row.setdefault(r, []).append(k)
    final = ActName("resid_post", a.structure.n_layers - 1)
    with torch.no_grad():
        for idx in length_batches([len(r) for r in rows], batch_size):
            tokens, _ = pad([rows[r] for r in idx], pad_id(a))
            ks = [k for r in idx for k in by_row.get(r, [])]
            b = torch.tensor([idx.index(reads[k][0]) for k in ks])
            pos = torch.tensor([reads[k][1] for k in ks])
            tok = torch.tensor([reads[k][2] for k in ks])
            # only the read positions are unembedded (a 262,144-token vocabulary at every position of every
            # row would be most of the run): the last block's output there, through the final norm and W_U
            # and each (row, position) once: a prompt's answers are read at the same few positions
            resid = a.run(tokens, [final], logits=False).acts[final]
            cells, which = torch.unique(b * tokens.shape[1] + pos, return_inverse=True)
            rows_at = resid[(cells // tokens.shape[1]).to(resid.device), (cells % tokens.shape[1]).to(resid.device)]
            at = unembed_rows(a, rows_at).double().log_softmax(-1).cpu()
            logp[ks] = at[which, tok]
            greedy[ks] = at.argmax(-1)[which] == tok
    return ([[float(logp[c].sum()) for c in per] for per in where],
            [[bool(greedy[c].all()) for c in per] for per in where])


def deciding_prefixes(answers: list[tuple[int, ...]], wrong: list[tuple[int, ...]]
                      ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The shortest prefixes of an example's answers that decide the set: every answer and wrong answer
    starting with such a prefix lies in one set (greater-than after "17", start year 32: "4".."9" for the
    answers, "0".."2" for the wrong ones, then "33".."39" and "30".."32" after the shared "3")."""
    sets = [(q, 0) for q in dict.fromkeys(answers)] + [(q, 1) for q in dict.fromkeys(wrong)]
    out: tuple[list[tuple[int, ...]], list[tuple[int, ...]]] = ([], [])
    for q, side in sets:
        for k in range(1, len(q) + 1):
            if all(other == side for r, other in sets if r[:k] == q[:k]):
                if q[:k] not in out[side]:
                    out[side].append(q[:k])
                break
        else:
            raise ValueError(f"the answer {q} is also how an answer of the other set starts: no prefix decides it")
    return out


def sequence_metric(model: Any, td: TokenizedData, metric: str, batch_size: int = 32) -> torch.Tensor:
    """A task metric on whole answers (module docstring), one value per prompt."""
    assert td.answer_seqs is not None and td.wrong_seqs is not None
    if metric == "prob_diff":  # each set's probability: its deciding prefixes'
        decided = [deciding_prefixes(x, w) for x, w in zip(td.answer_seqs, td.wrong_seqs)]
        logp, _ = teacher_forced(model, td.prompts, [x + w for x, w in decided], batch_size)
        values = [float(torch.tensor(lp[:len(x)]).exp().sum() - torch.tensor(lp[len(x):]).exp().sum())
                  for lp, (x, _) in zip(logp, decided)]
        return torch.tensor(values, dtype=torch.float64)
    logp, greedy = teacher_forced(model, td.prompts, [x + w for x, w in zip(td.answer_seqs, td.wrong_seqs)],
                                  batch_size)
    n_ans = [len(x) for x in td.answer_seqs]
    if metric == "logit_diff":
        values = [sum(lp[:k]) / k - sum(lp[k:]) / (len(lp) - k) for lp, k in zip(logp, n_ans)]
    elif metric == "top1":
        values = [float(any(g[:k])) for g, k in zip(greedy, n_ans)]
    else:
        raise ValueError(f"no sequence reading of the metric {metric!r}")
    return torch.tensor(values, dtype=torch.float64)


def _mean_ci(key: str, values: torch.Tensor) -> dict[str, float]:
    """The mean over prompts with its 95% bootstrap interval (entoscope.stats defaults, seeded)."""
    from .stats import Stats, mean_stat, summarise

    x = values.double().cpu().numpy()[:, None]
    s = summarise(mean_stat(x), Stats(), seed=0)
    return {key: float(s.value[0]), f"{key}_ci_low": float(s.ci_low[0]), f"{key}_ci_high": float(s.ci_high[0])}


def _share_ci(key: str, hits: torch.Tensor) -> dict[str, float]:
    """A share of prompts with its 95% Wilson interval."""
    from .stats.proportion import wilson_interval

    k, n = int(hits.sum()), int(hits.numel())
    low, high = wilson_interval(k, n, LEVEL)
    return {key: k / n, f"{key}_ci_low": float(low), f"{key}_ci_high": float(high)}


def format_scores(scores: dict[str, dict[str, Any]]) -> str:
    lines = []
    for task, figs in scores.items():
        if "skipped" in figs:
            lines.append(f"{task:14s} skipped: {figs.get('reason')}")
            continue
        parts = [f"{k} {v:.3f}" + (f" [{figs[k + '_ci_low']:.3f}, {figs[k + '_ci_high']:.3f}]"
                                    if k + "_ci_low" in figs else "")
                 for k, v in figs.items() if _shown(k, v)]
        lines.append(f"{task:14s} " + ", ".join(parts) + f"  (n={int(figs['n'])})"
                     + (f"\n{'':14s} {figs['verdict']}: {figs['why']}" if "verdict" in figs else ""))
    lines.append("(95% intervals: Wilson for accuracies, bootstrap over prompts for means; *_sequence: whole "
                 "answers by teacher forcing, where answers are several tokens)")
    return "\n".join(lines)


def _shown(key: str, value: Any) -> bool:
    return key != "n" and isinstance(value, float) and not key.endswith(("_ci_low", "_ci_high"))
