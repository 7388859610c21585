"""The measures a sweep reads, and its frontier: the configurations nothing is shown to beat on memory and quality.

A point is dominated only when another point holds no more bytes and is *significantly* better on the same items
(a paired comparison: :func:`kvviz.studies.verdicts.significantly_better`); a point estimate a hair higher beats
nothing. The frontier is every point that is not dominated. A point without a measured quality (a failed run, a
measure that does not apply) is never on it and never beats anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    """One quality measure of a sweep: its name in the points, how it reads, which way is better, where its 95%
    interval is kept (None: a measure without one) and how a point is judged against full on it (``paired``:
    ``binary`` right/wrong per item, ``mean`` a per-item value, None: not judged)."""

    key: str
    label: str
    higher_is_better: bool
    percent: bool = False
    interval: str | None = None
    paired: str | None = None

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def text(self, value: float) -> str:
        return f"{value:.0%}" if self.percent else f"{value:.3g}"

    def with_interval(self, value: float, interval: tuple[float, float] | None) -> str:
        if interval is None:
            return self.text(value)
        low, high = (f"{v * 100:.0f}" if self.percent else f"{v:.3g}" for v in interval)
        return f"{self.text(value)} [{low}, {high}]"


AGREEMENT = Measure("agreement_with_full", "agreement with full", True, percent=True, interval="agreement_ci",
                    paired="mean")
MEAN_KL = Measure("mean_kl", "mean KL", False)
TAIL = Measure("tail_share", "share of prompts below the agreement threshold", False, percent=True,
               interval="tail_ci", paired="binary")
ACCURACY = Measure("accuracy", "accuracy", True, percent=True, interval="accuracy_ci", paired="binary")
PERPLEXITY = Measure("perplexity", "perplexity", False)
MEASURES = {m.key: m for m in (AGREEMENT, MEAN_KL, TAIL, ACCURACY, PERPLEXITY)}

Beats = Callable[[int, int], bool]  # whether the point at the first index is significantly better than the second


def on_frontier(points: Sequence[tuple[float | None, float | None]], measure: Measure,
                beats: Beats | None = None) -> list[bool]:
    """For each (bytes, quality) pair, whether no other pair with no more bytes beats it. ``beats(i, j)`` says
    whether point i is significantly better than point j; without it (a measure with no items to pair, such as
    one play's perplexity) a strictly better point estimate beats, and so does the same quality in fewer bytes."""
    measured = [(i, b, q) for i, (b, q) in enumerate(points) if b is not None and q is not None]

    def dominates(other: int, other_size: float, other_quality: float, index: int, size: float,
                  quality: float) -> bool:
        if other_size > size:
            return False
        if beats is not None:
            return beats(other, index)
        return not measure.better(quality, other_quality) and (
            other_size < size or measure.better(other_quality, quality))

    flags = [False] * len(points)
    for index, size, quality in measured:
        flags[index] = not any(dominates(other, other_size, other_quality, index, size, quality)
                               for other, other_size, other_quality in measured if other != index)
    return flags
