"""The verdicts' error rates and power, proven by simulation through the sweep's own decision code.

A scenario is a sweep whose truth is known: full answers each item right with probability ``full_accuracy``; each
point loses an item (full right, the point wrong) with probability ``loss`` and gains one (the reverse) with
probability ``gain``, independently across items. Every simulated sweep then runs as a real one does: rounds of
``round_items`` items; after each round every open point's anytime-valid p-values (its
:class:`~kvviz.studies.sequential.Wealth` advanced by the round's units) go through
:meth:`kvviz.studies.sequential.Design.look`, and :class:`~kvviz.studies.sequential.Allocation` stops the points it
decides, until every point is decided or the cap is reached. The counts of wrong claims over
many runs, with their Monte Carlo intervals, are the error rates (``python -m kvviz sweep --simulate``, pinned by
tests/test_simulation.py); the same runs give the power and the items a decision takes, which is what the plan
reads (:mod:`kvviz.studies.power`).

The fixed-n rule of earlier rounds (Newcombe's interval above minus the margin, at one look) runs through the same
looks too, to show what looking after every round does to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvviz.studies.intervals import wilson
from kvviz.studies.paired import newcombe_lower
from kvviz.studies.sequential import (
    BEYOND,
    CLAIMS,
    ONE_SIDED,
    OPEN,
    ROUND_ITEMS,
    WITHIN,
    WORSE,
    Allocation,
    Design,
    Families,
    Wealth,
)

CHUNK = 1000  # simulated sweeps computed at once (memory: chunk x points x cap x bets floats)


@dataclass(frozen=True)
class SimulatedPoint:
    """One point of a simulated sweep: its family (points of one family are listed least compressed first), and the
    shares of items it loses and gains against full."""

    family: int
    loss: float
    gain: float = 0.0

    @property
    def difference(self) -> float:
        return self.gain - self.loss


@dataclass(frozen=True)
class Scenario:
    """A sweep whose truth is known (module docstring); ``margin`` is a share (0.05 = 5 points)."""

    points: tuple[SimulatedPoint, ...]
    full_accuracy: float = 0.75
    margin: float = 0.05
    cap: int = 512
    round_items: int = ROUND_ITEMS

    def __post_init__(self):
        for point in self.points:
            if not (0 <= point.loss <= self.full_accuracy and 0 <= point.gain <= 1 - self.full_accuracy):
                raise ValueError(f"a point cannot lose {point.loss:.0%} and gain {point.gain:.0%} of the items when "
                                 f"full is right on {self.full_accuracy:.0%}")

    @property
    def design(self) -> Design:
        return Design(self.margin, Families.of([(str(p.family), -order) for order, p in enumerate(self.points)]))

    def looks(self) -> list[int]:
        """The item counts the looks fall at: after every round, the last at the cap."""
        return sorted({*range(self.round_items, self.cap, self.round_items), self.cap})


@dataclass
class Simulated:
    """Every simulated sweep's result per point, shape (runs, points): the final verdict, the verdict it stopped on
    (OPEN: it reached the cap) and the items it used; and, when asked, whether the fixed-n rule, looked at after
    every round, ever called it within the margin, and whether it did at the cap alone."""

    scenario: Scenario
    verdicts: np.ndarray
    stops: np.ndarray
    items: np.ndarray
    fixed_rule_peeking: np.ndarray | None = None
    fixed_rule_at_cap: np.ndarray | None = None

    @property
    def runs(self) -> int:
        return self.verdicts.shape[0]


def _draw(scenario: Scenario, runs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Full's right/wrong per item (runs, cap) and every point's (runs, points, cap)."""
    full = rng.random((runs, scenario.cap)) < scenario.full_accuracy
    loses = np.array([p.loss / scenario.full_accuracy for p in scenario.points])[None, :, None]
    gains = np.array([p.gain / (1 - scenario.full_accuracy) if scenario.full_accuracy < 1 else 0.0
                      for p in scenario.points])[None, :, None]
    chance = rng.random((runs, len(scenario.points), scenario.cap))
    ours = np.where(full[:, None, :], chance >= loses, chance < gains)
    return full, ours


def _fixed_rule(full: np.ndarray, ours: np.ndarray, margin: float, looks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Newcombe's lower bound above minus the margin: ever at any look, and at the last look alone."""
    both_right = np.cumsum(full[:, None, :] & ours, axis=-1)
    lost = np.cumsum(full[:, None, :] & ~ours, axis=-1)
    gained = np.cumsum(~full[:, None, :] & ours, axis=-1)
    ever = np.zeros(ours.shape[:2], dtype=bool)
    for n in looks:
        within = newcombe_lower(both_right[..., n - 1], lost[..., n - 1], gained[..., n - 1],
                                n - both_right[..., n - 1] - lost[..., n - 1] - gained[..., n - 1]) > -margin
        ever |= within
    return ever, within


def simulate(scenario: Scenario, runs: int, seed: int = 0, fixed_rule: bool = False) -> Simulated:
    """``runs`` sweeps of ``scenario`` (module docstring), in chunks, from ``seed``."""
    rng = np.random.default_rng(seed)
    design, looks = scenario.design, scenario.looks()
    parts: list[tuple[np.ndarray, ...]] = []
    for start in range(0, runs, CHUNK):
        size = min(CHUNK, runs - start)
        full, ours = _draw(scenario, size, rng)
        differences = ours.astype(float) - full[:, None, :]
        wealth = {claim: Wealth(ours.shape[:2], scenario.margin, claim) for claim in CLAIMS}
        allocation = Allocation(design, size)
        used = np.zeros(ours.shape[:2], dtype=int)
        for previous, n in zip([0, *looks], looks, strict=False):  # every open point has used ``previous`` items
            where = np.nonzero(allocation.open)
            block = differences[where[0], where[1], previous:n]
            for claim in CLAIMS:
                wealth[claim].advance(block, where)
            used[where] = n
            allocation.look({claim: w.p for claim, w in wealth.items()})
            if not allocation.open.any():
                break
        extra = _fixed_rule(full, ours, scenario.margin, looks) if fixed_rule else ()
        parts.append((allocation.last.verdicts, allocation.stops, used, *extra))
    joined = [np.concatenate(arrays) for arrays in zip(*parts, strict=True)]
    return Simulated(scenario, *joined)


@dataclass(frozen=True)
class Rate:
    """How often something happened over the runs, with its 95% Monte Carlo (Wilson) interval."""

    count: int
    runs: int

    @property
    def share(self) -> float:
        return self.count / self.runs

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.count, self.runs)

    def text(self) -> str:
        low, high = self.interval
        return f"{self.share:.2%} [{low:.2%}, {high:.2%}] ({self.count:,} of {self.runs:,})"

    def to_json(self) -> dict:
        return {"count": self.count, "runs": self.runs, "share": round(self.share, 5),
                "interval": [round(v, 5) for v in self.interval]}


def rate(flags: np.ndarray) -> Rate:
    return Rate(int(np.count_nonzero(flags)), int(flags.size))


@dataclass(frozen=True)
class PowerRow:
    """One true loss: how often a point is proven within the margin by the cap, how often its loss is proven
    (beyond the margin, or worse than full), how often anything is decided, and the median items to a decision
    (None: fewer than half decide)."""

    loss_points: float
    within: Rate
    loss_proven: Rate
    decided: Rate
    median_items: float | None

    def to_json(self) -> dict:
        return {"loss_points": self.loss_points, "within": self.within.to_json(),
                "loss_proven": self.loss_proven.to_json(), "decided": self.decided.to_json(),
                "median_items": self.median_items}


def power_row(simulated: Simulated, loss_points: float, point: int = 0) -> PowerRow:
    """What the runs say about the point at index ``point``."""
    stops = simulated.stops[:, point]
    decided = stops != OPEN
    items = simulated.items[:, point]
    median = float(np.median(np.where(decided, items, np.inf))) if decided.mean() >= 0.5 else None
    verdicts = simulated.verdicts[:, point]
    return PowerRow(loss_points, rate(verdicts == WITHIN), rate(np.isin(verdicts, (BEYOND, WORSE))), rate(decided),
                    median)


@dataclass
class ErrorRates:
    """The figures ``sweep --simulate`` prints (module docstring): each claim's error where its null holds at the
    edge, alone and across three families, the fixed-n rule's with and without peeking, and the power."""

    runs: int
    cap: int
    round_items: int
    margin: float
    rates: dict[str, Rate] = field(default_factory=dict)
    power: list[PowerRow] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"{self.runs:,} simulated sweeps per scenario, rounds of {self.round_items} items up to {self.cap}, "
               f"margin {100 * self.margin:g} points, each claim at {ONE_SIDED:.1%} (95% Monte Carlo intervals):"]
        out += [f"- {EXPLAINED[name]}: {rate_.text()}" for name, rate_ in self.rates.items()]
        out.append("Power, three families each with one point at the loss, full right on 75%:")
        for row in self.power:
            median = "-" if row.median_items is None else f"{row.median_items:.0f}"
            out.append(f"- {row.loss_points:g} points lost: proven within {row.within.share:.1%} by {self.cap} items, "
                       f"decided {row.decided.share:.1%}, median items to a decision {median}")
        return out

    def to_json(self) -> dict:
        return {"runs": self.runs, "cap": self.cap, "round_items": self.round_items, "margin": self.margin,
                "rates": {name: r.to_json() for name, r in self.rates.items()},
                "power": [row.to_json() for row in self.power]}


EXPLAINED = {
    "within_at_margin": "within, one point losing exactly the margin, full right on 75%",
    "beyond_at_margin": "beyond, the same point (its null's edge too)",
    "within_at_margin_half": "within, one point losing exactly the margin, full right on 50%",
    "beyond_at_zero": "beyond, one point identical in law to full (no loss), full right on 75%",
    "worse_at_zero": "worse, the same point",
    "family_within": "some within across 3 families of 2 points, each first at the margin, each second at 3x it",
    "family_beyond": "some beyond across 3 families of 2 points, all at no loss",
    "fixed_rule_peeking": "the fixed-n rule (Newcombe) looked at after every round, one point at the margin, full "
                          "right on 50%",
    "fixed_rule_at_cap": "the fixed-n rule at the cap alone, the same runs",
}
POWER_LOSSES = (0.0, 1.0, 2.5)  # points


def error_rates(runs: int = 10_000, cap: int = 256, round_items: int = ROUND_ITEMS, margin: float = 0.05,
                seed: int = 0) -> ErrorRates:
    """Every figure of :class:`ErrorRates`, each scenario from its own seed."""
    def run(points, accuracy=0.75, fixed_rule=False, offset=0) -> Simulated:
        scenario = Scenario(tuple(points), accuracy, margin, cap, round_items)
        return simulate(scenario, runs, seed + offset, fixed_rule)

    out = ErrorRates(runs, cap, round_items, margin)
    edge = run([SimulatedPoint(0, margin)], offset=1)
    out.rates["within_at_margin"] = rate(edge.verdicts[:, 0] == WITHIN)
    out.rates["beyond_at_margin"] = rate(edge.verdicts[:, 0] == BEYOND)
    half = run([SimulatedPoint(0, margin)], accuracy=0.5, fixed_rule=True, offset=2)
    out.rates["within_at_margin_half"] = rate(half.verdicts[:, 0] == WITHIN)
    zero = run([SimulatedPoint(0, 0.0)], offset=3)
    out.rates["beyond_at_zero"] = rate(zero.verdicts[:, 0] == BEYOND)
    out.rates["worse_at_zero"] = rate(np.isin(zero.verdicts[:, 0], (WORSE, BEYOND)))
    families = run([SimulatedPoint(f, loss) for f in range(3) for loss in (margin, 3 * margin)], offset=4)
    out.rates["family_within"] = rate((families.verdicts == WITHIN).any(axis=1))
    alike = run([SimulatedPoint(f, 0.0) for f in range(3) for _ in range(2)], offset=5)
    out.rates["family_beyond"] = rate((alike.verdicts == BEYOND).any(axis=1))
    out.rates["fixed_rule_peeking"] = rate(half.fixed_rule_peeking[:, 0])
    out.rates["fixed_rule_at_cap"] = rate(half.fixed_rule_at_cap[:, 0])
    for offset, loss in enumerate(POWER_LOSSES):
        simulated = run([SimulatedPoint(f, loss / 100) for f in range(3)], offset=10 + offset)
        out.power.append(power_row(simulated, loss))
    return out
