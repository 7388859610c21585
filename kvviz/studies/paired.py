"""Judging a configuration against full on the same items: the paired difference, its interval, a test, a margin.

Every configuration of a sweep runs on the same items as the full cache, so each item gives a pair of outcomes.
Comparing two intervals (one per configuration) throws that pairing away: their overlap is not a test, and a
configuration that loses 6 of 32 items and gains none can still overlap full. The pairs say more:

- **binary outcomes** (right or wrong per item): the 2x2 table of both right, *lost* (full right, this wrong),
  *gained* (the reverse) and both wrong. The difference is ``(gained - lost) / n``; its 95% interval is Newcombe's
  hybrid score interval for paired proportions (method 10 of Newcombe 1998: the Wilson intervals of both rates,
  without continuity correction, combined through the table's phi coefficient, with Newcombe's adjustment of phi
  towards zero by n/2 when it is positive, and zero when a margin is empty). The test of "no difference" is the exact
  McNemar test: under it the lost items among the discordant ones are Binomial(lost + gained, 1/2).
- **a mean over items** (agreement with full per prompt): the mean paired difference with a bootstrap percentile
  interval over the items (or over groups of items sharing one document, when groups are given). A bootstrap sees
  no spread in a few equal differences, so it alone would call three lossless prompts proof of a 5-point margin. Its
  margin test is therefore floored by what k independent units (items, or groups) can show at all: with per-unit
  losses bounded by 1 and a mean loss of m, every unit comes out lossless with probability up to (1 - m)^k (a loss of
  1 on a share m of units), so no test that favours smaller observed losses proves the margin on fewer units than
  k = ln(0.025) / ln(1 - m): 72 at 5 points, the same order as the 73 items the plan asks of right/wrong outcomes.

A *margin* is the loss the user accepts, in points. A configuration is ``within_margin`` when its interval's lower
bound lies above minus the margin (non-inferiority), ``worse`` when its upper bound lies below zero, and
``inconclusive`` otherwise: it could hide a loss as large as minus the lower bound. For right/wrong outcomes ``worse``
also needs the exact McNemar test to reject. Testing many points multiplies
the chances of a false "within margin"; each point's one-sided p-value of the margin test (``margin_p``) is
therefore adjusted by Holm's step-down method across the sweep before a recommendation names a point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvviz.studies.intervals import Z95, Interval, percentile_interval, resample_means, wilson

ALPHA = 0.05  # two-sided: the 95% interval; the margin test is its one-sided half, 0.025
WITHIN, WORSE, INCONCLUSIVE = "within_margin", "worse", "inconclusive"
VERDICTS = (WITHIN, WORSE, INCONCLUSIVE)
DEFAULT_MARGIN = 5.0  # points of accuracy (or agreement) a deployment may lose: the usual non-inferiority margin


@dataclass(frozen=True)
class Table:
    """The paired 2x2 table of one configuration against full over the same items."""

    both_right: int
    lost: int
    gained: int
    both_wrong: int

    @property
    def items(self) -> int:
        return self.both_right + self.lost + self.gained + self.both_wrong

    @classmethod
    def of(cls, full: Sequence[bool], other: Sequence[bool]) -> Table:
        pairs = list(zip(full, other, strict=True))
        return cls(sum(f and o for f, o in pairs), sum(f and not o for f, o in pairs),
                   sum(o and not f for f, o in pairs), sum(not f and not o for f, o in pairs))


def newcombe_paired(table: Table, z: float = Z95) -> Interval | None:
    """The interval of (this configuration's rate - full's rate) by Newcombe's method 10 (module docstring)."""
    n = table.items
    if n == 0:
        return None
    ours, theirs = table.both_right + table.gained, table.both_right + table.lost
    p_ours, p_theirs = ours / n, theirs / n
    low_ours, high_ours = wilson(ours, n, z)
    low_theirs, high_theirs = wilson(theirs, n, z)
    phi = _phi(table)
    below = math.sqrt(max(0.0, (p_ours - low_ours) ** 2 - 2 * phi * (p_ours - low_ours) * (high_theirs - p_theirs)
                          + (high_theirs - p_theirs) ** 2))
    above = math.sqrt(max(0.0, (p_theirs - low_theirs) ** 2 - 2 * phi * (p_theirs - low_theirs) * (high_ours - p_ours)
                          + (high_ours - p_ours) ** 2))
    difference = p_ours - p_theirs
    return max(-1.0, difference - below), min(1.0, difference + above)


def _phi(table: Table) -> float:
    """The table's phi coefficient as Newcombe's method uses it: 0 when a margin is empty, a positive one shrunk by
    n/2 (and never below 0), a negative one as it is."""
    a, b, c, d, n = table.both_right, table.gained, table.lost, table.both_wrong, table.items
    product = (a + b) * (c + d) * (a + c) * (b + d)
    if product == 0:
        return 0.0
    cross = a * d - b * c
    if cross > n / 2:
        return (cross - n / 2) / math.sqrt(product)
    return cross / math.sqrt(product) if cross < 0 else 0.0


def mcnemar_exact(lost: int, gained: int) -> float:
    """The two-sided exact McNemar p-value: twice the smaller binomial tail of the discordant items, at most 1."""
    discordant = lost + gained
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(lost, gained) + 1)) / 2 ** discordant
    return min(1.0, 2 * tail)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of ``p_values`` (None stays None and is not counted)."""
    present = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(present):
        running = max(running, min(1.0, (len(present) - rank) * p))
        adjusted[index] = running
    return adjusted


def verdict(interval: Interval | None, margin_points: float, p_value: float | None = None) -> str:
    """``within_margin``, ``worse`` or ``inconclusive`` for an interval of the difference (module docstring). With
    an exact test beside the interval (``p_value``), ``worse`` also needs the test to reject: the two can disagree at
    the edge (5 lost of 8: the interval ends below zero, p = 0.0625), and the exact test is the conservative one."""
    if interval is None:
        return INCONCLUSIVE
    if interval[0] > -margin_points / 100:
        return WITHIN
    rejected = p_value is None or p_value < ALPHA
    return WORSE if interval[1] < 0 and rejected else INCONCLUSIVE


def margin_p_binary(table: Table, margin_points: float) -> float:
    """The one-sided p-value of "the loss is smaller than the margin": the level at which Newcombe's lower bound
    meets minus the margin (1 when the observed difference is already beyond it)."""
    margin = margin_points / 100
    n = table.items
    if n == 0 or (table.gained - table.lost) / n <= -margin:
        return 1.0
    low, high = 0.0, 40.0  # z: the lower bound falls as z grows
    if newcombe_paired(table, high)[0] > -margin:
        return _upper_tail(high)
    for _ in range(60):
        middle = (low + high) / 2
        if newcombe_paired(table, middle)[0] > -margin:
            low = middle
        else:
            high = middle
    return _upper_tail(low)


def _upper_tail(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


@dataclass(frozen=True)
class Paired:
    """One configuration against full on the same items. ``lost``/``gained`` count items (binary outcomes; for a
    mean, the items below and above full); ``difference`` and its interval are in rate units (0.05 = 5 points);
    ``p_value`` the exact McNemar test (None for a mean); ``margin_p`` the one-sided test of the margin, adjusted
    across the sweep in ``margin_p_adjusted`` (Holm), as ``p_value`` is in ``p_adjusted``."""

    items: int
    lost: int
    gained: int
    difference: float
    difference_ci: Interval | None
    p_value: float | None
    margin_p: float
    verdict: str
    p_adjusted: float | None = None
    margin_p_adjusted: float | None = None
    units_needed: int | None = None  # set where the interval clears the margin but too few units stand behind it

    @property
    def hidden_loss(self) -> float | None:
        """The largest loss (points) the interval leaves possible, when it is a loss."""
        return None if self.difference_ci is None or self.difference_ci[0] >= 0 else -100 * self.difference_ci[0]

    def describe(self) -> str:
        """The verdict as a predicate: ``is worse than full``, ``is within the margin``, ``could hide a loss of up to
        12 points``."""
        if self.verdict == WORSE:
            return "is worse than full"
        if self.verdict == WITHIN:
            return "is within the margin"
        if self.units_needed:
            return (f"is inconclusive: {self.items} items cannot prove the margin, however alike (at least "
                    f"{self.units_needed} can)")
        return f"could hide a loss of up to {self.hidden_loss:.0f} points" if self.hidden_loss else "is inconclusive"

    def interval_text(self) -> str:
        if self.difference_ci is None:
            return f"{100 * self.difference:+.1f} points"
        low, high = self.difference_ci
        return f"{100 * self.difference:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}]"

    def to_json(self) -> dict:
        data = asdict(self)
        data["difference"] = round(self.difference, 4)
        data["difference_ci"] = None if self.difference_ci is None else [round(v, 4) for v in self.difference_ci]
        for key in ("p_value", "p_adjusted", "margin_p", "margin_p_adjusted"):
            data[key] = None if data[key] is None else round(data[key], 6)
        return data


def paired_binary(full: Sequence[bool], other: Sequence[bool], margin_points: float,
                  groups: Sequence[str] | None = None) -> Paired:
    """A configuration's right/wrong per item against full's. With ``groups`` the interval and the margin test
    resample whole groups (items sharing a document are not independent); McNemar's p still counts items."""
    table = Table.of(full, other)
    difference = (table.gained - table.lost) / table.items
    if groups is None:
        interval, margin_p = newcombe_paired(table), margin_p_binary(table, margin_points)
    else:
        means = resample_means([float(o) - float(f) for f, o in zip(full, other, strict=True)], groups)
        return _floored(Paired(table.items, table.lost, table.gained, difference, percentile_interval(means),
                               mcnemar_exact(table.lost, table.gained), _bootstrap_margin_p(means, margin_points),
                               ""), len(set(groups)), margin_points)
    p_value = mcnemar_exact(table.lost, table.gained)
    return Paired(table.items, table.lost, table.gained, difference, interval, p_value, margin_p,
                  verdict(interval, margin_points, p_value))


def paired_mean(differences: Sequence[float], margin_points: float, groups: Sequence[str] | None = None) -> Paired:
    """A configuration's per-item difference from full (e.g. agreement minus full's 1.0): the mean, its bootstrap
    interval and the bootstrap margin test (the share of resampled means at or below minus the margin)."""
    means = resample_means(differences, groups)
    units = len(differences) if groups is None else len(set(groups))
    return _floored(Paired(len(differences), sum(d < 0 for d in differences), sum(d > 0 for d in differences),
                           float(np.mean(differences)), percentile_interval(means), None,
                           _bootstrap_margin_p(means, margin_points), ""), units, margin_points)


def units_to_prove(margin_points: float) -> int:
    """The fewest independent units that can prove ``margin_points`` when none of them lost anything (module
    docstring): the least k with (1 - m)^k below the one-sided level."""
    return math.floor(math.log(ALPHA / 2) / math.log(1 - margin_points / 100)) + 1


def _floored(paired: Paired, units: int, margin_points: float) -> Paired:
    """A bootstrap judgement with its margin test floored by what ``units`` independent units can show, and its
    verdict set: ``within_margin`` needs the floored test to pass as well as the interval to clear the margin."""
    floor = (1 - margin_points / 100) ** units
    judged = verdict(paired.difference_ci, margin_points, paired.p_value)
    blocked = judged == WITHIN and floor >= ALPHA / 2
    return replace(paired, margin_p=max(paired.margin_p, floor), verdict=INCONCLUSIVE if blocked else judged,
                   units_needed=units_to_prove(margin_points) if blocked else None)


def _bootstrap_margin_p(means: np.ndarray | None, margin_points: float) -> float:
    if means is None:
        return 1.0
    return float((np.count_nonzero(means <= -margin_points / 100) + 1) / (means.size + 1))
