"""One configuration against full on the same items: the units, the paired difference, and what it proves.

Every configuration of a sweep runs on the same items as the full cache, so each item gives a pair of outcomes.
Comparing two intervals (one per configuration) throws that pairing away: their overlap is not a test. The pairs say
more. Right/wrong outcomes fall into *both right*, *lost* (full right, this wrong), *gained* (the reverse) and *both
wrong*; a per-item value (agreement with full) gives a difference per item. Items sharing a document are not
independent, so the *unit* of every test is the group: its difference is the mean over its items. With no groups,
each item is its own unit.

What a difference proves is decided by the anytime-valid tests of :mod:`kvviz.studies.sequential`, across every
point of the sweep at once (:mod:`kvviz.studies.verdicts`); :class:`Paired` holds one point's result in words and
numbers. Newcombe's interval for paired proportions (method 10 of Newcombe 1998), the fixed-n rule of earlier
rounds, is kept for one purpose: :mod:`kvviz.studies.simulation` runs it through the same looks to show why it was
replaced (it is approximate, and looked at after every round it passes a loss at the margin far more often than 2.5%).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvviz.studies.intervals import Z95, Interval
from kvviz.studies.sequential import BEYOND, OPEN, WITHIN, WORDS, WORSE

DEFAULT_MARGIN = 5.0  # points of accuracy (or agreement) a deployment may lose: the usual non-inferiority margin
VERDICT_WITHIN, VERDICT_BEYOND, VERDICT_WORSE, INCONCLUSIVE = WORDS[WITHIN], WORDS[BEYOND], WORDS[WORSE], WORDS[OPEN]
VERDICTS = (VERDICT_WITHIN, VERDICT_BEYOND, VERDICT_WORSE, INCONCLUSIVE)
BELOW_FULL = (VERDICT_BEYOND, VERDICT_WORSE)  # the verdicts that prove a loss


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


def _wilson_arrays(successes: np.ndarray, n: np.ndarray, z: float) -> tuple[np.ndarray, np.ndarray]:
    rate = successes / n
    denominator = 1 + z * z / n
    centre = (rate + z * z / (2 * n)) / denominator
    half = z * np.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / denominator
    return np.maximum(0.0, centre - half), np.minimum(1.0, centre + half)


def newcombe_lower(both_right, lost, gained, both_wrong, z: float = Z95) -> np.ndarray:
    """The lower bound of Newcombe's method-10 interval of (this rate - full's rate), for arrays of table counts:
    the two rates' Wilson intervals combined through the table's phi coefficient (0 when a margin is empty, a
    positive one shrunk by n/2 and never below 0)."""
    a, b, c, d = (np.asarray(x, dtype=float) for x in (both_right, gained, lost, both_wrong))
    n = a + b + c + d
    ours, theirs = a + b, a + c
    low_ours, _ = _wilson_arrays(ours, n, z)
    _, high_theirs = _wilson_arrays(theirs, n, z)
    product = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.where(product == 0, 0.0, np.where(cross > n / 2, (cross - n / 2) / np.sqrt(product),
                                                   np.where(cross < 0, cross / np.sqrt(product), 0.0)))
    p_ours, p_theirs = ours / n, theirs / n
    below = np.sqrt(np.maximum(0.0, (p_ours - low_ours) ** 2 - 2 * phi * (p_ours - low_ours) * (high_theirs - p_theirs)
                               + (high_theirs - p_theirs) ** 2))
    return np.maximum(-1.0, p_ours - p_theirs - below)


def unit_differences(full: Sequence[float], other: Sequence[float], groups: Sequence[str] | None = None
                     ) -> np.ndarray:
    """Each unit's difference (other - full): per item, or per group (the mean over its items) in the order the
    groups first appear."""
    differences = np.asarray(other, dtype=float) - np.asarray(full, dtype=float)
    if groups is None:
        return differences
    names = list(dict.fromkeys(groups))
    index = {name: i for i, name in enumerate(names)}
    member = np.asarray([index[g] for g in groups])
    return np.bincount(member, weights=differences, minlength=len(names)) / np.bincount(member, minlength=len(names))


@dataclass(frozen=True)
class Paired:
    """One configuration against full on the same items (``items``; ``units`` independent ones: items, or groups).
    ``lost``/``gained`` count items (for a per-item value, the items below and above full); ``difference`` and its
    anytime-valid 95% interval are in rate units (0.05 = 5 points). The p-values are anytime-valid, one per claim
    (``p_value``: below full; ``margin_p``: within the margin; ``beyond_p``: beyond it), and ``*_adjusted`` after the
    closed procedure across every point of the sweep, whose decision is ``verdict``. ``bound`` is the confidence
    bound the verdict rests on, at the level its claim passed (``bound_level``). ``exploratory``: read at a margin
    other than the one fixed before the run."""

    items: int
    units: int
    lost: int
    gained: int
    difference: float
    difference_ci: Interval | None
    p_value: float
    margin_p: float
    beyond_p: float
    verdict: str
    margin: float
    p_adjusted: float | None = None
    margin_p_adjusted: float | None = None
    beyond_p_adjusted: float | None = None
    bound: float | None = None
    bound_level: float | None = None
    units_needed: int | None = None  # set when too few units stand behind an inconclusive verdict to prove anything
    exploratory: bool = False

    @property
    def hidden_loss(self) -> float | None:
        """The largest loss (points) the interval leaves possible, when it is a loss."""
        return None if self.difference_ci is None or self.difference_ci[0] >= 0 else -100 * self.difference_ci[0]

    def describe(self) -> str:
        """The verdict as a predicate: ``is within the margin (it loses at most 3.1 points)``, ``could hide a loss
        of up to 12 points``."""
        bound = None if self.bound is None else abs(100 * self.bound)
        if self.verdict == VERDICT_WITHIN:
            return f"is within the margin (it loses at most {max(0.0, -100 * self.bound):.1f} points)"
        if self.verdict == VERDICT_BEYOND:
            return f"is beyond the margin (it loses at least {bound:.1f} points)"
        if self.verdict == VERDICT_WORSE:
            return (f"is worse than full (by at least {bound:.1f} points), within the {self.margin:g}-point margin "
                    "unproven")
        if self.units_needed:
            unit = "units" if self.units != self.items else "items"
            return (f"is inconclusive: {self.units} {unit} cannot prove the margin, however alike (at least "
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
        for key in ("p_value", "p_adjusted", "margin_p", "margin_p_adjusted", "beyond_p", "beyond_p_adjusted",
                    "bound", "bound_level"):
            data[key] = None if data[key] is None else round(data[key], 6)
        return data
