"""`Vocabulary`: every token id's text, decoded on its own when first asked for (kept on the tokenizer).

A table or page names a few tokens (the answers, the top predictions, a prompt's tokens); decoding all
of a 50,000- or 150,000-token vocabulary for them cost a first call tens of milliseconds. Control
characters (byte tokens such as NUL) are written as escapes, `\\x00`, so that no table cell or page
holds a raw control character. Ids past the tokenizer's own (a model's padded vocabulary) read `<id>`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0, 32), 127] if chr(c) not in "\n\t"}
_CONTROL.update({ord("\n"): "\\n", ord("\t"): "\\t"})


def printable(text: str) -> str:
    return text.translate(_CONTROL)


class Vocabulary(Sequence[str]):
    """The texts of token ids 0..size-1; `vocab[i]` decodes id i once, `take(ids)` an array of them. A negative
    or too large id is an IndexError (it is never wrapped round)."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer, self.size = tokenizer, size
        self.known = min(size, len(tokenizer))
        self._texts: dict[int, str] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        i = int(i)
        if not 0 <= i < self.size:  # a negative id is a missing token, never the last one
            raise IndexError(f"token id {i} is outside the vocabulary (0..{self.size - 1})")
        text = self._texts.get(i)
        if text is None:
            text = self._texts[i] = printable(self.tokenizer.decode([i])) if i < self.known else f"<{i}>"
        return text

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(self.size))

    def take(self, ids: Any) -> np.ndarray:
        """The texts of an array of ids, as an object array of the same shape."""
        ids = np.asarray(ids)
        out = np.empty(ids.shape, dtype=object)
        flat = out.reshape(-1)
        for j, i in enumerate(ids.reshape(-1).tolist()):
            flat[j] = self[i]
        return out


def vocabulary(tokenizer: Any, size: int) -> Vocabulary:
    """The tokenizer's `Vocabulary` of `size` ids, kept on it (made again when its vocabulary grows)."""
    vocab = tokenizer.__dict__.get("_entoscope_vocab")
    if not isinstance(vocab, Vocabulary) or vocab.size != size or vocab.known != min(size, len(tokenizer)):
        vocab = Vocabulary(tokenizer, size)
        tokenizer.__dict__["_entoscope_vocab"] = vocab
    return vocab
