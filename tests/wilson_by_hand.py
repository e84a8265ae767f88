"""The Wilson score interval written out by hand (Wilson 1927), for the tests of shares of prompts: an
independent check of entoscope.stats.proportion, with z from the standard library's normal quantile."""

from statistics import NormalDist


def wilson_by_hand(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)
