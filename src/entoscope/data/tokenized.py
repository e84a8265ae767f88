"""From a `Dataset` to batches of tokens: tokenising with explicit BOS, checking pairs and answers,
and batching by length with right padding.

Right padding with no attention mask is exact for causal models: a real token never attends to a
later pad and keeps its position, so every number read at a real position equals a one-prompt
run (tests check it). Prompts are grouped by length to waste little compute on pads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import DataError, warn
from ..models.adapter import ModelAdapter
from .examples import Dataset
from .roles import END, RoleTable, role_table

AnswerScoring = Literal["first_token", "single", "sequence"]


@dataclass
class TokenizedData:
    """Token ids of every prompt (and counterfactual, answers) of a dataset, validated."""

    dataset: Dataset
    prompts: list[list[int]]
    counterfactuals: list[list[int]] | None
    answers: list[list[int]] | None  # the token read for each answer (see answer_scoring)
    wrong_answers: list[list[int]] | None
    prepend_bos: bool
    roles: RoleTable | None = None  # token position of each role in each prompt (END always)
    cf_roles: RoleTable | None = None  # the same in each counterfactual
    answer_seqs: list[list[tuple[int, ...]]] | None = None  # every token of each answer (teacher forcing)
    wrong_seqs: list[list[tuple[int, ...]]] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)


def tokenize_data(model: ModelAdapter, data: Dataset, *, prepend_bos: bool = True, pairs: bool = False,
                  answers: bool = False, answer_scoring: AnswerScoring = "first_token",
                  align: Literal["refuse", "end"] = "refuse") -> TokenizedData:
    """Tokenise and validate a dataset for an operation.

    pairs:   counterfactuals are needed; each must have its prompt's token length (or align="end").
    answers: answer tokens are needed, read by `answer_scoring`:
             first_token  an answer's first token stands for it (one token: itself); answers of several
                          tokens are counted and said in one warning (answer_first_token: the plan's notes,
                          result.warnings, the manifest, the page). A first token that
                          starts both a correct and a wrong answer of an example (greater-than on a digit
                          tokenizer: "33" and "32" both start with "3") decides nothing and is read for
                          neither; an example left with no correct or no wrong token is refused
                          (answer_first_tokens_shared: two names split as " Ma|ry", " Ma|rk").
             single       each answer must be ONE token (multi_token_answer otherwise).
             sequence     as first_token here; `answer_seqs` / `wrong_seqs` (always filled) hold every
                          token of each answer for a teacher-forced reading (evaluate.py).
    An answer written as a special token (`<|name|>`, `</s>`, `[SEP]`) that the tokenizer lacks, and so splits,
    is refused (special_token_answer) rather than read by its first piece (`<`).
    """
    if len(data) == 0:
        raise DataError(f"dataset {data.name!r} is empty", code="data_empty", remedy="give at least one example")
    prompts = [model.tokenize(e.prompt, prepend_bos=prepend_bos and isinstance(e.prompt, str)) for e in data]
    n_ctx = model.structure.n_ctx
    for i, p in enumerate(prompts):
        check_ids(model, p, data[i].prompt, f"prompt {i}", prepend_bos)
        if len(p) > n_ctx:
            raise DataError(f"prompt {i} is {len(p)} tokens, longer than the model's context ({n_ctx})",
                            code="prompt_too_long", remedy="shorten or drop it")
    cfs = None
    if pairs:
        missing = [i for i, e in enumerate(data) if e.counterfactual is None]
        if missing:
            raise DataError(f"{len(missing)} examples have no counterfactual (first: {missing[:5]})",
                            code="data_no_counterfactuals",
                            remedy="use a task with counterfactuals (ioi, induction, facts, greater_than) or "
                            "add a 'counterfactual' field to each record")
        cfs = [model.tokenize(e.counterfactual, prepend_bos=prepend_bos and isinstance(e.counterfactual, str))
               for e in data]  # type: ignore[arg-type]
        for i, c in enumerate(cfs):
            check_ids(model, c, data[i].counterfactual, f"counterfactual {i}", prepend_bos)
        if align == "refuse":
            for i, (p, c) in enumerate(zip(prompts, cfs)):
                if len(p) != len(c):
                    raise DataError(
                        f"pair {i}: the prompt is {len(p)} tokens and its counterfactual {len(c)} "
                        f"({data[i].prompt!r} vs {data[i].counterfactual!r})", code="lengths_differ",
                        remedy="make the pair the same token length, or pass an alignment (align='end' "
                        "aligns the two on their last tokens)")
    ans = wrong = None
    if answers:
        missing = [i for i, e in enumerate(data) if not e.answers]
        if missing:
            raise DataError(f"{len(missing)} examples have no answer (first: {missing[:5]})",
                            code="data_no_answers", remedy="give each example an 'answers' field")
        ans_seqs = [_answer_seqs(model, e.answers, i, answer_scoring) for i, e in enumerate(data)]
        wrong_seqs = [_answer_seqs(model, e.wrong_answers, i, answer_scoring) for i, e in enumerate(data)]
        if answer_scoring == "first_token":
            warn_cut_answers(model, data, ans_seqs, wrong_seqs)
        if answer_scoring == "single":
            ans, wrong = [[q[0] for q in a] for a in ans_seqs], [[q[0] for q in w] for w in wrong_seqs]
        else:
            firsts = [_first_tokens(a, w, i, data[i]) for i, (a, w) in enumerate(zip(ans_seqs, wrong_seqs))]
            ans, wrong = [a for a, _ in firsts], [w for _, w in firsts]
    roles = role_table(model, [e.prompt for e in data], prompts, [e.roles for e in data], prepend_bos)
    cf_table = None
    if cfs is not None:
        cf_table = role_table(model, [e.counterfactual for e in data], cfs, [e.cf_roles for e in data], prepend_bos)
        cf_table = _fill_from_prompts(cf_table, roles, [len(p) == len(c) for p, c in zip(prompts, cfs)])
    td = TokenizedData(data, prompts, cfs, ans, wrong, prepend_bos, roles, cf_table)  # type: ignore[arg-type]
    if answers:
        td.answer_seqs, td.wrong_seqs = ans_seqs, wrong_seqs
    return td


def _fill_from_prompts(cf: RoleTable, prompts: RoleTable, same_length: list[bool]) -> RoleTable:
    """A counterfactual without roles of its own takes its prompt's token positions (same length only)."""
    names = tuple(sorted((set(cf.names) | set(prompts.names)) - {END})) + (END,)
    pos = torch.full((cf.positions.shape[0], len(names)), -1, dtype=torch.long)
    for j, name in enumerate(names):
        if name in cf.names:
            pos[:, j] = cf.positions[:, cf.index(name)]
        if name in prompts.names:
            take = (pos[:, j] < 0) & torch.tensor(same_length)
            pos[:, j] = torch.where(take, prompts.positions[:, prompts.index(name)], pos[:, j])
    return RoleTable(names, pos)


def check_ids(model: ModelAdapter, ids: list[int], given: object, what: str, prepend_bos: bool) -> None:
    """A prompt is at least one token, and every id is in the model's vocabulary."""
    if not ids:
        raise DataError(f"{what} is empty: it has no token to run", code="empty_prompt",
                        remedy="give it some text, or keep prepend_bos: true (the BOS token alone is a prompt)")
    V = model.structure.d_vocab
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise DataError(f"{what} holds token id(s) {bad[:5]} outside the vocabulary (0..{V - 1})",
                        code="token_out_of_range", remedy="token ids must be in 0..d_vocab - 1 of this model")
    if isinstance(given, str) and given.strip() and len(ids) == int(prepend_bos):
        raise DataError(f"{what} ({given[:40]!r}) tokenised to no token at all: the tokenizer has no vocabulary",
                        code="tokenizer_empty_output",
                        remedy="load a model whose folder has its tokenizer files (tokenizer.json or vocab.json)")


def _answer_seqs(model: ModelAdapter, tokens: tuple, index: int, scoring: AnswerScoring) -> list[tuple[int, ...]]:
    """Every answer's token ids (one id given as an int is itself); "single" refuses several tokens; an answer
    written as a special token the tokenizer lacks is refused (special_token_answer)."""
    out = []
    for t in tokens:
        if isinstance(t, str) and scoring != "single":
            ids = model.tokenize(t, prepend_bos=False)
            if not ids:
                raise DataError(f"example {index}: the answer {t!r} is empty", code="empty_answer",
                                remedy="give a non-empty answer")
            if len(ids) > 1 and looks_special(t):
                _refuse_special(model, t, ids, index)
            out.append(tuple(ids))
            continue
        try:
            out.append((model.token_id(t),))
        except DataError as err:
            raise DataError(f"example {index}: {err.message}", code=err.code, remedy=err.remedy) from None
    return out


# written like a special token: <|name|> (GPT-2, Llama 3, Qwen), <s> </s> <eos> <pad> <start_of_turn> ... (SentencePiece,
# Gemma), [CLS] [SEP] [MASK] (BERT). Checked only on answers the tokenizer splits: one it has is one token.
_SPECIAL = re.compile(r"^\s*(<\|[^<>|\s]+\|>|</?(s|pad|unk|eos|bos|mask|sep|cls|eot|(start|end)_of_\w+)>"
                      r"|\[(CLS|SEP|PAD|UNK|MASK|BOS|EOS)\])\s*$", re.IGNORECASE)


def looks_special(text: str) -> bool:
    """Whether `text` is written like a special token (<|endoftext|>, </s>, <start_of_turn>, [SEP])."""
    return bool(_SPECIAL.match(text))


def _refuse_special(model: ModelAdapter, text: str, ids: list[int], index: int) -> None:
    pieces = [model.tokenizer.decode([i]) for i in ids]
    have = [t for t in (getattr(model.tokenizer, "all_special_tokens", None) or []) if isinstance(t, str)][:8]
    raise DataError(f"example {index}: the answer {text!r} is written as a special token, but this tokenizer has no "
                    f"such token: it splits it into {len(ids)} pieces {pieces}, and the first, {pieces[0]!r}, would "
                    "be read in its place", code="special_token_answer",
                    remedy="use a special token this tokenizer has" + (f" ({', '.join(have)})" if have else "")
                    + ", or the answer's plain text")


FIRST_TOKEN_BY_DESIGN = "first_token_by_design"  # an example's meta key: its answers are meant to be read by
# their first token (e.g. greater-than's first digit on a digit tokenizer), so no answer_first_token warning


def warn_cut_answers(model: ModelAdapter, data: Dataset, answers: list[list[tuple[int, ...]]],
                     wrong: list[list[tuple[int, ...]]]) -> int:
    """Warn (answer_first_token) when answers of several tokens are read by their first token (the default
    reading), saying how many; returns that count (0: no warning). Examples whose meta holds
    `first_token_by_design` (the reading is their metric, as greater-than's on a digit tokenizer) are left out."""
    cut = [(i, q) for i, rows in enumerate(zip(answers, wrong)) for side in rows for q in side if len(q) > 1
           and not (data[i].meta or {}).get(FIRST_TOKEN_BY_DESIGN)]
    if not cut:
        return 0
    total = sum(len(a) + len(w) for a, w in zip(answers, wrong))
    examples = len({i for i, _ in cut})
    i, q = cut[0]
    whole, first = model.tokenizer.decode(list(q)), model.tokenizer.decode([q[0]])
    warn(f"{len(cut)} of {total} answers (in {examples} of {len(data)} examples) are several tokens under this "
         f"tokenizer and are read by their first token (answer_scoring first_token, the default): e.g. {whole!r} "
         f"({len(q)} tokens, example {i}) is read as {first!r}; answer_scoring: single refuses them, sequence "
         "(where offered) reads every token", code="answer_first_token")
    return len(cut)


def _first_tokens(answers: list[tuple[int, ...]], wrong: list[tuple[int, ...]], index: int,
                  example: object) -> tuple[list[int], list[int]]:
    """The first tokens of an example's answers and wrong answers, each once, without those starting both."""
    firsts_a = list(dict.fromkeys(a[0] for a in answers))
    firsts_w = list(dict.fromkeys(w[0] for w in wrong))
    shared = set(firsts_a) & set(firsts_w)
    kept_a, kept_w = [t for t in firsts_a if t not in shared], [t for t in firsts_w if t not in shared]
    if (firsts_a and not kept_a) or (firsts_w and not kept_w):
        raise DataError(f"example {index}: its correct and wrong answers start with the same token(s) {sorted(shared)} "
                        f"({getattr(example, 'answers', ())[:3]!r} vs {getattr(example, 'wrong_answers', ())[:3]!r}), "
                        "so their first token cannot tell them apart", code="answer_first_tokens_shared",
                        remedy="use answers whose first tokens differ (mind the leading space), or "
                        "answer_scoring: sequence where it is offered (entoscope info, the report's task scores)")
    return kept_a, kept_w


@dataclass
class Batch:
    """A right-padded batch of prompts (and their counterfactuals and answers)."""

    index: list[int]  # which examples, in dataset order numbers
    tokens: Tensor  # [B, T]
    lengths: Tensor  # [B]
    cf_tokens: Tensor | None = None  # [B, T']
    cf_lengths: Tensor | None = None
    answers: Tensor | None = None  # [B, A], -1 where a row has fewer answers
    wrong_answers: Tensor | None = None  # [B, W]
    roles: Tensor | None = None  # [B, R] token position of each role of TokenizedData.roles

    @property
    def last(self) -> Tensor:
        """Position of each prompt's last token (where the next-token prediction is read)."""
        return self.lengths - 1

    @property
    def cf_last(self) -> Tensor:
        assert self.cf_lengths is not None
        return self.cf_lengths - 1

    def __len__(self) -> int:
        return len(self.index)


def pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists: ([B, max_len] long tensor, [B] lengths)."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return tokens, torch.tensor([len(s) for s in seqs], dtype=torch.long)


def pad_answers(rows: list[list[int]]) -> Tensor:
    """Answer-id lists -> [n, widest] long tensor, -1 where a row is shorter."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Example indices grouped in batches of similar length (sorted by length, stable)."""
    if batch_size < 1:
        raise DataError(f"batch size {batch_size} must be at least 1", code="bad_batch_size",
                        remedy="use batch_size >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def make_batches(td: TokenizedData, batch_size: int, pad_id: int) -> list[Batch]:
    """Batches over the whole dataset (every example exactly once)."""
    lengths = [max(len(p), len(c)) for p, c in zip(td.prompts, td.counterfactuals)] if td.counterfactuals \
        else td.lengths
    batches = []
    for idx in length_batches(lengths, batch_size):
        tokens, lens = pad([td.prompts[i] for i in idx], pad_id)
        b = Batch(idx, tokens, lens, roles=None if td.roles is None else td.roles.subset(idx))
        if td.counterfactuals is not None:
            b.cf_tokens, b.cf_lengths = pad([td.counterfactuals[i] for i in idx], pad_id)
        if td.answers is not None:
            b.answers = pad_answers([td.answers[i] for i in idx])
            b.wrong_answers = pad_answers([td.wrong_answers[i] for i in idx])  # type: ignore[index]
        batches.append(b)
    return batches


def pad_id(model: ModelAdapter) -> int:
    """The id used for padding (never read: any id works; the tokenizer's pad, eos or bos, else 0)."""
    tok = model.tokenizer
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tok, attr, None)
        if value is not None:
            return int(value)
    return 0
