"""Plan before you run: what a sweep of N items can detect, and how many items proving a margin takes.

Two numbers, each under a stated assumption (:data:`ASSUMPTIONS`):

- the **detectable loss**: the smallest share of items a configuration must lose (and gain none back) for the exact
  McNemar test at alpha = 0.05 to call it different from full with 80% power. With no gains the test rejects when at
  least six items are lost (two-sided p = 2 / 2^lost <= 0.05), so the power is P(Binomial(N, loss) >= 6).
- the **items for the margin**: the fewest items at which even a configuration that matches full item for item is
  proven within the margin by Newcombe's interval, when full answers every item right (the widest case: with some
  items wrong for both, the table's correlation narrows the interval). Any lost item only raises it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvviz.studies.paired import ALPHA, Table, mcnemar_exact, newcombe_paired

POWER = 0.8
ASSUMPTIONS = {
    "detectable_loss": "exact McNemar, two-sided alpha 0.05, 80% power; the configuration loses that share of the "
                       "items and gains none, and full answers at least that share right",
    "items_for_margin": "Newcombe's 95% interval; the configuration matches full on every item and full answers "
                        "every item right; any lost item needs more",
}
MAX_ITEMS = 100_000


@dataclass(frozen=True)
class Plan:
    """What a sweep on ``items`` items can tell at ``margin`` points (module docstring). ``detectable_loss`` is in
    points (None: too few items for any loss to be detected); ``items_for_margin`` a count."""

    items: int
    margin: float
    detectable_loss: float | None
    items_for_margin: int | None
    assumptions: dict[str, str]

    def sentence(self) -> str:
        detect = (f"a configuration must lose at least {self.detectable_loss:.0f}% of the items (and gain none) for "
                  "this run to call it worse than full with 80% power" if self.detectable_loss is not None else
                  f"no loss can be called significant with {self.items} items (the exact test needs 6 lost)")
        needed = self.items_for_margin
        prove = ("" if needed is None else
                 f"; proving a configuration within {self.margin:g} points of full takes at least {needed:,} items"
                 + (" (this run has enough for a configuration that matches full)" if self.items >= needed else ""))
        return f"With {self.items} items, {detect}{prove}."

    def to_json(self) -> dict:
        data = asdict(self)
        if data["detectable_loss"] is not None:
            data["detectable_loss"] = round(data["detectable_loss"], 2)
        return data


def rejecting_losses() -> int:
    """The fewest lost items (none gained) at which the exact McNemar test rejects at :data:`ALPHA`."""
    lost = 1
    while mcnemar_exact(lost, 0) > ALPHA:
        lost += 1
    return lost


def power_against(items: int, loss: float) -> float:
    """P(at least :func:`rejecting_losses` lost of ``items``) when each item is lost with probability ``loss``."""
    needed = rejecting_losses()
    return 1.0 - sum(math.comb(items, k) * loss ** k * (1 - loss) ** (items - k) for k in range(needed))


def detectable_loss(items: int, power: float = POWER) -> float | None:
    """The smallest loss (a share) detected with ``power`` on ``items`` items; None with fewer items than the test
    needs lost."""
    if items < rejecting_losses():
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (low, middle) if power_against(items, middle) >= power else (middle, high)
    return high


def items_for_margin(margin_points: float) -> int | None:
    """The fewest items proving a configuration identical to an always-right full within ``margin_points`` (None
    when even :data:`MAX_ITEMS` do not)."""
    def proven(n: int) -> bool:
        return newcombe_paired(Table(n, 0, 0, 0))[0] > -margin_points / 100

    if margin_points <= 0 or not proven(MAX_ITEMS):
        return None
    low, high = 1, MAX_ITEMS
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if proven(middle) else (middle + 1, high)
    return low


def plan(items: int, margin_points: float) -> Plan:
    """The plan of a sweep on ``items`` items judged at ``margin_points``."""
    loss = detectable_loss(items)
    return Plan(items, margin_points, None if loss is None else 100 * loss, items_for_margin(margin_points),
                dict(ASSUMPTIONS))
