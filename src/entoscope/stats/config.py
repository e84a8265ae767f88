"""`Stats`: how an operation summarises its per-prompt values (a field of every operation's config)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from ..config_model import ConfigModel

ROUGH_TAIL = 5  # resamples beyond each end of an interval below which it is warned about (few_resamples)


def tail_resamples(n_boot: int, ci_level: float) -> float:
    """How many bootstrap resamples lie beyond each end of a ci_level interval: n_boot (1 - ci_level) / 2
    (rounded to 9 digits: 20 resamples at 90% are 1, not 0.9999999999999998)."""
    return round(n_boot * (1 - ci_level) / 2, 9)


def min_boot(ci_level: float, tail: float = 1) -> int:
    """The smallest n_boot that puts `tail` resamples beyond each end of a ci_level interval."""
    return math.ceil(round(2 * tail / (1 - ci_level), 9))


class Stats(ConfigModel):
    """Intervals, robust aggregation and multiple comparisons (docs/statistics.md).

    n_boot:           bootstrap resamples of the prompts (0: no intervals). An interval's ends are the
                      resamples' (1 - ci_level) / 2 quantiles, so n_boot must put at least one resample
                      beyond each end (n_boot >= 2 / (1 - ci_level): 40 at 95%); fewer is refused, since
                      the "interval" would be the range of the resamples (n_boot 1: zero width). Below
                      ROUGH_TAIL resamples beyond each end (200 at 95%) a run warns (few_resamples): the
                      level is nominal and the ends move by much of their width from seed to seed.
                      1,000 (the default) or more for reported intervals (Efron and Tibshirani 1993, ch. 19).
    ci_level:         coverage of every interval, strictly between 0 and 1.
    ci_method:        "bca" (bias-corrected and accelerated, Efron 1987, at the small-sample-expanded
                      tail levels of Hesterberg 2015), "expanded_percentile" (the percentile interval at
                      those expanded levels) or "percentile" (the plain percentile interval: the
                      alpha/2 and 1 - alpha/2 quantiles of the bootstrap values, no expansion). The
                      p-values invert the chosen interval, so they follow it.
    degenerate_share: a pair whose clean-corrupt gap is below this share of the dataset's median |gap|
                      is degenerate: left out of per-pair ratios and counted.
    influence_share:  a cell whose value moves by more than this share of max(|value|, 10% of the
                      table's largest |value|) when its most influential prompt is left out is flagged
                      `fragile`.
    fdr:              level of the Benjamini-Hochberg step-up procedure behind the `significant`
                      column (over the table's cells, effect vs 0; what it controls: docs/statistics.md).
    refine_p:         where a cell's p sits at the interval's floor (2 / (n_boot + 1), widened), replace it
                      by the sign-flip test's p of the per-prompt values (stats/signflip.py), which the
                      data, not n_boot, limit (2^-(n-1) on n prompts). False: the floor stays.
    """

    n_boot: int = Field(default=1000, ge=0, le=100_000, description="bootstrap resamples of the prompts (0: no "
                        "intervals); at least 2 / (1 - ci_level); 1,000 or more for reported intervals")
    ci_level: float = Field(default=0.95, gt=0, lt=1, description="coverage of every interval, strictly between 0 "
                            "and 1")
    ci_method: Literal["bca", "expanded_percentile", "percentile"] = Field(default="bca", description="bca (Efron "
        "1987, at Hesterberg 2015's expanded levels), expanded_percentile or percentile; the p-values follow it")
    degenerate_share: float = Field(default=0.1, ge=0, lt=1, description="a pair whose clean-corrupt gap is below "
                                    "this share of the median |gap| is degenerate (left out of per-pair ratios)")
    influence_share: float = Field(default=0.5, gt=0, description="a cell that moves by more than this share when "
                                   "its most influential prompt is left out is flagged fragile")
    fdr: float = Field(default=0.05, gt=0, lt=1, description="level of the Benjamini-Hochberg procedure behind the "
                       "significant column")
    refine_p: bool = Field(default=True, description="replace a p at the interval's floor by the sign-flip test's p "
                           "of the per-prompt values")

    @model_validator(mode="after")
    def _enough_resamples(self) -> Stats:
        if self.n_boot and tail_resamples(self.n_boot, self.ci_level) < 1:
            raise ValueError(f"n_boot={self.n_boot} leaves no resample beyond the ends of a {self.ci_level:g} "
                             f"interval, which would be the range of the resamples (zero width for n_boot 1): use "
                             f"n_boot >= {min_boot(self.ci_level)} (1000 for reported intervals), or 0 for none")
        return self

    def rough_intervals(self) -> str:
        """What a run's intervals mean when few resamples lie beyond their ends ('' when enough do)."""
        tail = tail_resamples(self.n_boot, self.ci_level)
        if not self.n_boot or tail >= ROUGH_TAIL:
            return ""
        return (f"n_boot={self.n_boot}: each end of the {self.ci_level:g} intervals rests on {tail:g} resample(s) "
                f"beyond it, so their level is nominal and their ends move by much of their width between seeds; "
                f"use n_boot >= {min_boot(self.ci_level, ROUGH_TAIL)} (1000 for reported intervals)")
