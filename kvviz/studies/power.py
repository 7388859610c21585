"""Plan before you run: what a sweep can decide, as a power calculation by the same simulation the error rates come
from (:mod:`kvviz.studies.simulation`), never a best case.

Under stated assumptions (:attr:`Plan.assumptions`: full's accuracy, one point per family at each true loss, items
independent), the plan runs the sweep's own design (its families, margin, rounds and cap; one look at N for a fixed
design) many times and reports, per true loss, how often a point is proven within the margin by the cap, how often
its loss is proven (beyond the margin, or worse than full), and the median items to a decision.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvviz.studies.sequential import ONE_SIDED, ROUND_ITEMS, fewest_units
from kvviz.studies.simulation import PowerRow, Scenario, SimulatedPoint, power_row, simulate

PLAN_RUNS = 1000  # simulated sweeps per true loss: shares to about +-3 points, in about a second
DEFAULT_FULL_ACCURACY = 0.75  # the plan's assumption where nothing is known yet (a multikey task's full is near it)


def plan_losses(margin: float) -> tuple[float, ...]:
    """The true losses (points) a plan reports: none, 1 point, half the margin, and twice the margin."""
    return tuple(sorted({0.0, min(1.0, margin / 2), margin / 2, 2 * margin}))


@dataclass(frozen=True)
class Plan:
    """What a sweep of ``families`` families on up to ``items`` items (one look at ``items`` when not adaptive) can
    decide at ``margin`` points, one :class:`PowerRow` per assumed true loss."""

    items: int
    margin: float
    families: int
    adaptive: bool
    full_accuracy: float
    rows: tuple[PowerRow, ...]
    fewest_items: int  # the fewest independent items any test can prove the margin on, at a family's first level

    @property
    def assumptions(self) -> dict[str, str]:
        return {"full": f"full is right on {self.full_accuracy:.0%} of the items",
                "points": f"{self.families} famil{'ies' if self.families != 1 else 'y'}, each with one point at the "
                          "true loss (lost items only, none gained); items independent",
                "simulation": f"{PLAN_RUNS:,} simulated sweeps per loss through the sweep's own decisions"}

    def sentence(self) -> str:
        design = (f"Adaptive, up to {self.items} items in rounds of {ROUND_ITEMS}" if self.adaptive
                  else f"{self.items} items, one look")
        parts = []
        for row in self.rows:
            median = "" if row.median_items is None else f", median {row.median_items:.0f} items"
            if row.loss_points < self.margin:
                parts.append(f"losing {row.loss_points:g} points: proven within {row.within.share:.0%}{median}")
            else:
                parts.append(f"losing {row.loss_points:g} points: its loss proven {row.loss_proven.share:.0%}"
                             f"{median}")
        below = ("" if self.items >= self.fewest_items else
                 f" No configuration can be proven within the margin on {self.items} items, however alike: it takes "
                 f"at least {self.fewest_items}.")
        return (f"{design}, {self.families} famil{'ies' if self.families != 1 else 'y'}, a {self.margin:g}-point "
                f"margin, full right on {self.full_accuracy:.0%}. A configuration " + "; ".join(parts) + "." + below)

    def to_json(self) -> dict:
        return {"items": self.items, "margin": self.margin, "families": self.families, "adaptive": self.adaptive,
                "full_accuracy": self.full_accuracy, "fewest_items": self.fewest_items,
                "rows": [row.to_json() for row in self.rows], "assumptions": self.assumptions}


@functools.lru_cache(maxsize=64)
def plan(items: int, margin_points: float, families: int = 1, adaptive: bool = False,
         full_accuracy: float = DEFAULT_FULL_ACCURACY, runs: int = PLAN_RUNS) -> Plan:
    """The plan of a sweep (module docstring); ValueError for a margin or an accuracy it cannot simulate."""
    if not 0 < margin_points < 100:
        raise ValueError(f"a margin of {margin_points:g} points is not a loss between 0 and 100")
    if not 0 < full_accuracy <= 1:
        raise ValueError(f"full's accuracy {full_accuracy:g} is not in (0, 1]")
    families = max(1, families)
    rows = []
    for offset, loss in enumerate(plan_losses(margin_points)):
        if loss / 100 > full_accuracy:
            continue  # a point cannot lose more items than full gets right
        scenario = Scenario(tuple(SimulatedPoint(f, loss / 100) for f in range(families)), full_accuracy,
                            margin_points / 100, max(1, items), ROUND_ITEMS if adaptive else max(1, items))
        rows.append(power_row(simulate(scenario, runs, seed=offset), loss))
    return Plan(items, margin_points, families, adaptive, full_accuracy, tuple(rows),
                fewest_units(margin_points / 100, ONE_SIDED / families))
