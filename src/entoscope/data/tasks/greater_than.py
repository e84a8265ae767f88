"""Greater-than (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17" -> a year > 32.

Years are written whole (" 1732"). A tokenizer such as GPT-2's (and the demo's, which splits every digit
run into pairs) splits them as [" 17", "32"], so the next token after "... the year 17" is a two-digit
token WITHOUT a leading space: the answers are "33".."99" and the wrong answers "00".."32", one token each.

A digit tokenizer (SmolLM2's, Gemma 3's: " 1732" is [" ", "1", "7", "3", "2"]) ends the prompt with the
century's digits too, so the year's two digits follow as two tokens. The answers are still the strings
"33".."99" and "00".."32", now two tokens each, read by the operations' answer_scoring (data/tokenized.py):
  first_token (default)  the first digit: P(first digit > 3) - P(first digit < 3); the start year's own
                         first digit "3" starts both sets and decides nothing, so it is read for neither
                         (the decade-level comparison; a start year ending in 9, "1739", puts its
                         decade's digit with the wrong answers: every year it starts is not greater);
  sequence               (entoscope info, the report's task scores; evaluate.py) by teacher forcing, the
                         mass on valid first digits and then second digits: P(years > 32) =
                         P(4..9) + P(3) P(3..9 | 3), P(years <= 32) = P(0..2) + P(3) P(0..2 | 3), from
                         one forward of the prompt followed by "3" (Hanna et al.'s probability
                         difference, the year read digit by digit).
On such a tokenizer the start years end in 10..89, so that both first-digit sets are non-empty.
Under any other tokenizer only the years that split as " CC" + "YY" (one token each, or the digits of
both) are used.
"""

from __future__ import annotations

import random
from typing import Any

from entoscope.data.examples import Dataset, Example
from entoscope.data.tasks import vocab
from entoscope.data.tokenized import FIRST_TOKEN_BY_DESIGN
from entoscope.data.tasks._common import TaskParamError, TaskVocabularyError, encode, single_tokens, tokenizer_name

TEMPLATES: tuple[str, ...] = (
    "The {noun} lasted from the year {start} to the year {century}",
    "The {noun} started in the year {start} and ended in the year {century}",
    "The {noun} ran from the year {start} until the year {century}",
)
COUNTERFACTUAL_YY = 1  # Hanna et al.: the start year's last two digits become "01"
START_YY = range(2, 99)  # both answer sets are non-empty and differ from the counterfactual's
DIGIT_START_YY = range(10, 90)  # a digit tokenizer: both sets have first digits of their own


def year_sets(yy: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(answers, wrong_answers) for a start year ending in `yy`: "yy+1".."99" and "00".."yy"."""
    return vocab.TWO_DIGITS[yy + 1 :], vocab.TWO_DIGITS[: yy + 1]


def sentence(template: int, noun: str, century: int, yy: int, marked: bool = False) -> str:
    """The prompt of template `template` for the start year century * 100 + yy; `marked`: its start year
    marked with roles XX (the century's token, " 17") and YY (the two-digit token, "32")."""
    start = f"[[XX:{century}]][[YY:{yy:02d}]]" if marked else f"{century}{yy:02d}"
    return TEMPLATES[template].format(noun=noun, start=start, century=century)


def _valid_years(tokenizer: Any) -> list[tuple[int, int]]:
    """(century, yy) whose year " CCYY" is the tokens of " CC" then those of "YY" (and so is " CC01"):
    one two-digit token, or (a digit tokenizer) one token per digit, the same for all 100."""
    if tokenizer is None:
        return [(c, yy) for c in vocab.CENTURIES for yy in START_YY]
    digits = {d: encode(tokenizer, d) for d in vocab.TWO_DIGITS}
    lengths = {len(ids) for ids in digits.values()}
    if lengths == {2} and all(digits[d] == encode(tokenizer, d[0]) + encode(tokenizer, d[1]) for d in digits):
        start = DIGIT_START_YY
    elif lengths == {1}:
        start = START_YY
    else:
        bad = [d for d, ids in digits.items() if len(ids) != 1]
        raise TaskVocabularyError(
            f"task 'greater_than': {len(bad)} of the 100 two-digit numbers are not a single token under "
            f"tokenizer {tokenizer_name(tokenizer)!r} (e.g. {bad[0]!r}), and they are not one token per digit "
            "either; the answer sets need one of the two"
        )
    valid = []
    for c in vocab.CENTURIES:
        head = encode(tokenizer, f" {c}")
        ok = {yy for yy in range(100) if encode(tokenizer, f" {c}{yy:02d}") == head + digits[f"{yy:02d}"]}
        if COUNTERFACTUAL_YY in ok:
            valid += [(c, yy) for yy in start if yy in ok]
    return valid


def greater_than(n: int = 64, seed: int = 0, tokenizer: Any = None) -> Dataset:
    """Greater-than prompts; label = the start year's last two digits (2..98; 10..89 on a digit tokenizer).

    answers: the two-digit numbers greater than the start year's ("33".."99" for 1732), wrong_answers:
    those not greater ("00".."32"); one token each, or two on a digit tokenizer (module docstring). counterfactual: the same sentence with the start year ending in
    "01". meta: noun, century, yy, start_year, template, and first_token_by_design (a digit tokenizer's
    first-digit reading is this task's metric, so no answer_first_token warning: data/tokenized.py).
    """
    if n < 0:
        raise TaskParamError(f"greater_than: n must be >= 0, got {n}")
    nouns = single_tokens("greater_than", "nouns", vocab.GT_NOUNS, tokenizer, 1)
    years = _valid_years(tokenizer)
    if not years:
        raise TaskVocabularyError(
            f"task 'greater_than': no year of centuries {vocab.CENTURIES} tokenizes as [' CC', 'YY'] under "
            f"tokenizer {tokenizer_name(tokenizer)!r}"
        )
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        century, yy = rng.choice(years)
        noun = rng.choice(nouns)
        t = rng.randrange(len(TEMPLATES))

        answers, wrong = year_sets(yy)
        examples.append(
            Example(
                prompt=sentence(t, noun, century, yy, marked=True),
                counterfactual=sentence(t, noun, century, COUNTERFACTUAL_YY, marked=True),
                answers=answers,
                wrong_answers=wrong,
                label=yy,
                meta={"noun": noun, "century": century, "yy": yy, "start_year": century * 100 + yy, "template": t,
                      FIRST_TOKEN_BY_DESIGN: "the first digit: the decade-level comparison (module docstring)"},
            )
        )
    return Dataset(
        "greater_than",
        tuple(examples),
        description="Greater-than (Hanna et al. 2023); label = the start year's last two digits.",
        params={"task": "greater_than", "n": n, "seed": seed, "tokenizer": tokenizer_name(tokenizer)},
    )
