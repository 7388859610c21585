"""How sure a sweep's point is: 95% intervals for a rate over items and a mean over prompts, and the tail beside them.

A point measured on 32 items is a rate with an error bar, not a number: two configurations one item apart differ by
3 points of accuracy and may be the same method at this sample size. Two intervals:

- **Wilson score** for k successes out of n items (accuracy): it stays inside [0, 1] and behaves at 0 and n, where
  the textbook mean ± 1.96 standard errors collapses to a width of zero;
- **bootstrap percentile** for a mean over prompts (agreement with full): the prompts are resampled with
  replacement :data:`RESAMPLES` times from a fixed seed (so the same values give the same interval), and the interval
  is the 2.5th to the 97.5th percentile of the resampled means. Agreement is bounded and skewed (most prompts agree
  fully), so a symmetric t interval would run past 100%.

Two points are *indistinguishable at this sample size* when their intervals overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval
RESAMPLES = 2000
WILSON_RULE = "95% Wilson score interval over the items scored"
BOOTSTRAP_RULE = f"95% bootstrap percentile interval over prompts ({RESAMPLES:,} resamples, fixed seed)"

Interval = tuple[float, float]


def wilson(successes: int, trials: int, z: float = Z95) -> Interval | None:
    """The Wilson score interval of ``successes`` out of ``trials`` (None for no trials)."""
    if trials <= 0:
        return None
    if not 0 <= successes <= trials:
        raise ValueError(f"{successes} successes out of {trials} trials")
    rate = successes / trials
    denominator = 1 + z * z / trials
    centre = (rate + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean(values: Sequence[float], resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """The 95% bootstrap percentile interval of the mean of ``values`` (None for fewer than two values: one prompt
    says nothing about the spread)."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return None
    draws = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    means = data[draws].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def overlap(a: Interval | None, b: Interval | None) -> bool:
    """Whether two intervals share a value (a missing interval overlaps nothing)."""
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def percentile(values: Sequence[float], share: float) -> float | None:
    """The ``share`` (0..1) percentile of ``values`` by linear interpolation, None when there are none."""
    return float(np.percentile(np.asarray(values, dtype=float), 100 * share)) if len(values) else None
