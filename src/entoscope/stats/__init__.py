"""Dataset-level numbers with their uncertainty, computed from per-prompt values (never by re-running a model).

Every aggregate entoscope reports is a *weighted statistic* of a per-prompt table: a function that
takes prompt weights [K, n] and returns [K, U] (U cells: sites, edges, heads, ...). The same function
gives the value (all weights 1), the bootstrap distribution (multinomial resampling weights), and the
leave-one-out values (one weight 0) used for influence and the BCa acceleration. Statistics of weighted
sums (`SumsStat`: means, ratios of means) are read in blocks of prompts, so a dataset of any size is
summarised in memory that does not grow with it. See docs/statistics.md.
"""

from .bootstrap import FunctionStat, StatFn, Summary, fragile, leave_one_out, summarise
from .resample import Resampler, resample_weights
from .sums import RatioStat, SumsStat, mean_stat, ratio_stat, streamed_mean
from .columns import (ci_text, error_arrays, interval_columns, p_text, readable_p, significance_columns,
                      value_with_ci)
from .config import Stats
from .fdr import benjamini_hochberg
from .proportion import share_interval, wilson_interval

__all__ = ["FunctionStat", "RatioStat", "Resampler", "StatFn", "Stats", "SumsStat", "Summary", "benjamini_hochberg",
           "ci_text", "error_arrays", "fragile", "interval_columns", "leave_one_out", "mean_stat", "p_text",
           "ratio_stat", "readable_p", "resample_weights", "significance_columns", "streamed_mean", "summarise",
           "value_with_ci", "share_interval", "wilson_interval"]
