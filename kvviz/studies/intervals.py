"""How sure a sweep's point is: 95% intervals for a rate over items and a mean over prompts, and the tail beside them.

A point measured on 32 items is a rate with an error bar, not a number: two configurations one item apart differ by
3 points of accuracy and may be the same method at this sample size. Two intervals:

- **Wilson score** for k successes out of n items (accuracy): it stays inside [0, 1] and behaves at 0 and n, where
  the textbook mean ± 1.96 standard errors collapses to a width of zero;
- **bootstrap percentile** for a mean over prompts (agreement with full): the prompts are resampled with
  replacement :data:`RESAMPLES` times from a fixed seed (so the same values give the same interval), and the interval
  is the 2.5th to the 97.5th percentile of the resampled means. Agreement is bounded and skewed (most prompts agree
  fully), so a symmetric t interval would run past 100%. Prompts sharing one document are not independent: with
  groups, whole groups are resampled (a cluster bootstrap), which widens the interval as it should.

These intervals describe one configuration. Whether two configurations differ is a paired question on the same
items (:mod:`kvviz.studies.paired`): overlapping intervals are not a test.
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


def resample_means(values: Sequence[float], groups: Sequence[str] | None = None, resamples: int = RESAMPLES,
                   seed: int = 0) -> np.ndarray | None:
    """The means of ``resamples`` bootstrap resamples of ``values`` (items drawn with replacement, or whole groups
    when ``groups`` names each item's), from a fixed seed; None for fewer than two units to draw."""
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    if groups is None:
        if data.size < 2:
            return None
        return data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    names = list(dict.fromkeys(groups))
    if len(names) < 2:
        return None
    index = {name: i for i, name in enumerate(names)}
    member = np.asarray([index[g] for g in groups])
    sums = np.bincount(member, weights=data, minlength=len(names))
    sizes = np.bincount(member, minlength=len(names)).astype(float)
    drawn = rng.integers(0, len(names), size=(resamples, len(names)))
    return sums[drawn].sum(axis=1) / sizes[drawn].sum(axis=1)


def percentile_interval(means: np.ndarray | None) -> Interval | None:
    """The 2.5th to the 97.5th percentile of resampled means (None without them)."""
    if means is None:
        return None
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def bootstrap_mean(values: Sequence[float], groups: Sequence[str] | None = None) -> Interval | None:
    """The 95% bootstrap percentile interval of the mean of ``values`` (None for fewer than two units to draw: one
    prompt says nothing about the spread), resampling whole groups when ``groups`` names each value's."""
    return percentile_interval(resample_means(values, groups))


def percentile(values: Sequence[float], share: float) -> float | None:
    """The ``share`` (0..1) percentile of ``values`` by linear interpolation, None when there are none."""
    return float(np.percentile(np.asarray(values, dtype=float), 100 * share)) if len(values) else None
