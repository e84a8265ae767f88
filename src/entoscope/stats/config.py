"""`Stats`: how an operation summarises its per-prompt values (a field of every operation's config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config_model import ConfigModel


class Stats(ConfigModel):
    """Intervals, robust aggregation and multiple comparisons (docs/statistics.md).

    n_boot:           bootstrap resamples of the prompts (0: no intervals).
    ci_level:         coverage of every interval.
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
    """

    n_boot: int = Field(default=1000, ge=0, le=100_000)
    ci_level: float = Field(default=0.95, gt=0, lt=1)
    ci_method: Literal["bca", "expanded_percentile", "percentile"] = "bca"
    degenerate_share: float = Field(default=0.1, ge=0, lt=1)
    influence_share: float = Field(default=0.5, gt=0)
    fdr: float = Field(default=0.05, gt=0, lt=1)
