"""Induction: a random sequence of words, then its repeat cut short; the next word is predictable only
by finding the earlier occurrence of the current word and copying what followed it.

Every word is written with a leading space (the prompt too starts with a space), so each word is one
token and a prompt of period L cut at k is exactly L + k tokens long.
"""

from __future__ import annotations

import random
from typing import Any

from entoscope.data.examples import Dataset, Example
from entoscope.data.tasks import vocab
from entoscope.data.tasks._common import TaskParamError, demo_vocab_size, single_tokens, spaced, tokenizer_name


def induction(n: int = 64, seed: int = 0, tokenizer: Any = None, length: int = 10) -> Dataset:
    """Prompts " w0 w1 ... w(L-1) w0 ... w(k-1)" with L = `length` distinct words and 2 <= k < L.

    answers = (" wk",); wrong_answers = (another word of the sequence,). The counterfactual has a
    different first half (L other words, none of the sequence's) and the same second half, so the
    answer has no support in it. meta: period (= L), k, words, counterfactual_words.
    """
    if length < 3:
        raise TaskParamError(f"induction: length must be >= 3 (the repeat is cut at 2 <= k < length), got {length}")
    if n < 0:
        raise TaskParamError(f"induction: n must be >= 0, got {n}")
    words = single_tokens("induction", "words", vocab.INDUCTION_WORDS, tokenizer, 2 * length)
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        seq = rng.sample(words, length)
        k = rng.randint(2, length - 1)
        answer = seq[k]
        wrong = rng.choice([w for w in seq if w != answer])
        others = [w for w in words if w not in seq]
        cf_first = rng.sample(others, length)
        examples.append(
            Example(
                prompt=_marked(seq, seq[:k]),
                counterfactual=_marked(cf_first, seq[:k]),
                answers=(" " + answer,),
                wrong_answers=(" " + wrong,),
                meta={"period": length, "k": k, "words": seq, "counterfactual_words": cf_first},
            )
        )
    return Dataset(
        "induction",
        tuple(examples),
        description="Repeated random word sequences cut short; predict the next word of the repeat.",
        params={"task": "induction", "n": n, "seed": seed, "length": length,
                "tokenizer": tokenizer_name(tokenizer)},
    )


def _marked(first: list[str], second: list[str]) -> str:
    """The prompt with roles A1 (the current token's first occurrence), B1 (the token after it, what an
    induction head attends to and copies); the current token, A2, is END."""
    k = len(second)
    words = [f" [[A1:{w}]]" if i == k - 1 else f" [[B1:{w}]]" if i == k else " " + w for i, w in enumerate(first)]
    return "".join(words) + spaced(second)


def repeated_tokens(
    n: int = 16,
    seed: int = 0,
    vocab_size: int | None = None,
    length: int = 20,
    bos_token_id: int | None = 0,
    tokenizer: Any = None,
) -> Dataset:
    """Token-id prompts: BOS, then `length` random ids from the whole vocabulary, repeated twice.

    For head scores on random tokens (the TransformerLens head-detector convention): in the second
    repeat, position i's induction target is i - length + 1. The ids of a sequence are distinct and
    never the BOS id. vocab_size defaults to len(tokenizer) when one is given, else to the
    demo model's. With
    bos_token_id=None no BOS is put first. meta: period, offset (1 with a BOS, else 0), tokens.
    """
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else demo_vocab_size()
    if length < 1:
        raise TaskParamError(f"repeated_tokens: length must be >= 1, got {length}")
    pool = [t for t in range(vocab_size) if t != bos_token_id]
    if len(pool) < length:
        raise TaskParamError(
            f"repeated_tokens: a vocabulary of {vocab_size} ids has fewer than length={length} usable ids"
        )
    rng = random.Random(seed)
    head = () if bos_token_id is None else (bos_token_id,)
    examples = []
    for _ in range(n):
        seq = tuple(rng.sample(pool, length))
        examples.append(
            Example(prompt=head + seq + seq, meta={"period": length, "offset": len(head), "tokens": list(seq)})
        )
    return Dataset(
        "repeated_tokens",
        tuple(examples),
        description="BOS + random token ids repeated twice (induction head scores).",
        params={"task": "repeated_tokens", "n": n, "seed": seed, "vocab_size": vocab_size,
                "length": length, "bos_token_id": bos_token_id},
    )
