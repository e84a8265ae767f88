"""Helpers shared by the task generators: tokenizer checks and the demo model's folder."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from entoscope.errors import DataError

DEMO_DIR = Path(__file__).resolve().parents[2] / "demo"


class TaskVocabularyError(DataError):
    """Too few of a task's words are single tokens under the given tokenizer."""

    code = "task_vocabulary"

    def __init__(self, message: str) -> None:
        super().__init__(message, remedy="use a model whose tokenizer has these words as single tokens, or your "
                         "own data (a JSONL file with prompt, counterfactual, answers)")


class TaskParamError(DataError):
    """A task parameter outside what the task can generate (n < 0, a too short length, ...)."""

    code = "task_param_invalid"

    def __init__(self, message: str) -> None:
        super().__init__(message, remedy="docs/demo_model.md lists each task's parameters and their ranges")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens, for an HF tokenizer or a `tokenizers.Tokenizer`."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def tokenizer_name(tokenizer: Any) -> str | None:
    if tokenizer is None:
        return None
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def single_tokens(
    task: str, what: str, words: Sequence[str], tokenizer: Any, minimum: int, prefix: str = " "
) -> list[str]:
    """The words that are one token (written after `prefix`); all of them when tokenizer is None.

    Raises TaskVocabularyError when fewer than `minimum` survive.
    """
    if tokenizer is None:
        kept = list(words)
    else:
        kept = [w for w in words if len(encode(tokenizer, prefix + w)) == 1]
    if len(kept) < minimum:
        raise TaskVocabularyError(
            f"task {task!r}: only {len(kept)} of {len(words)} {what} are a single token "
            f"(written as {prefix + words[0]!r}) under tokenizer {tokenizer_name(tokenizer)!r}; "
            f"the task needs at least {minimum}"
        )
    return kept


def spaced(words: Iterable[str]) -> str:
    return "".join(" " + w for w in words)


def demo_vocab_size() -> int:
    """The vocabulary size of the bundled demo model (read from its config.json)."""
    config = DEMO_DIR / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"the demo model's config is missing: {config}")
    return int(json.loads(config.read_text())["vocab_size"])
