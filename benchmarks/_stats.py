"""Medians with bootstrap confidence intervals (seeded, so a report is reproducible from its
samples)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

RESAMPLES = 2000
LEVEL = 0.95


def _interval(estimates: list[float], level: float) -> tuple[float, float]:
    estimates.sort()
    tail = (1.0 - level) / 2.0
    lo = estimates[int(tail * (len(estimates) - 1))]
    hi = estimates[int((1.0 - tail) * (len(estimates) - 1))]
    return lo, hi


def median_ci(
    values: Sequence[float], level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """``(median, low, high)``: the median of ``values`` and a percentile-bootstrap confidence
    interval for it."""
    rng = random.Random(seed)
    n = len(values)
    estimates = [statistics.median(rng.choices(values, k=n)) for _ in range(RESAMPLES)]
    return (statistics.median(values), *_interval(estimates, level))


def ratio_of_medians_ci(
    numerator: Sequence[float], denominator: Sequence[float], level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``median(numerator) / median(denominator)`` for two independent
    samples, with a percentile-bootstrap confidence interval (each sample resampled)."""
    rng = random.Random(seed)
    estimates = [
        statistics.median(rng.choices(numerator, k=len(numerator)))
        / statistics.median(rng.choices(denominator, k=len(denominator)))
        for _ in range(RESAMPLES)
    ]
    ratio = statistics.median(numerator) / statistics.median(denominator)
    return (ratio, *_interval(estimates, level))
