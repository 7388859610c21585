"""Anytime-valid paired tests: every point of a sweep against full, looked at after every round of items, stopped
whenever it is decided, and still wrong at most 2.5% of the time per claim, across all families together.

Each unit (an item, or a group of items sharing a document) gives a paired difference ``d`` in [-1, 1]: the point's
outcome minus full's (right/wrong as 1/0, or agreement). The mean difference ``theta`` is what a verdict is about;
``m`` is the margin (0.05 for 5 points). Three one-sided claims are tested, each by *betting* against its null
(Waudby-Smith & Ramdas, JRSS-B 2023): a gambler starts with wealth 1 and, on every unit, stakes a share of it on the
claim; under the null no bet wins on average, so the wealth is a nonnegative supermartingale and, by Ville's
inequality, it ever reaches 1/a with probability at most a, however often it is looked at and whenever it is stopped.
The wealth is a mixture: a weighted average of :data:`FRACTIONS` constant bets, each a share of the largest safe bet
(the one that loses everything on the worst possible unit). A mixture needs no tuning and, at a fixed count, gives the
same wealth whatever the units' order; its grid leans towards large bets, which is what items identical to full call
for, and :data:`LARGEST_WEIGHT` of the stake rides on the largest bet itself: the bet that the point never loses a unit
to full, which a cache quantized to 8 bits often wins (docs/quality.md compares grids and weights by simulation).

- ``within``: the loss is smaller than the margin (null ``theta <= -m``, bets on ``d + m``);
- ``beyond``: the loss is larger than the margin (null ``theta >= -m``, bets against ``d + m``);
- ``worse``: the point is below full (null ``theta >= 0``, bets against ``d``).

No test of a bounded mean can prove a margin on fewer than ``ln(1/a) / -ln(1 - m)`` units, however alike: a loss of
m spread as a loss of 1 on a share m of the units leaves all k of them lossless with probability (1 - m)^k
(:func:`fewest_units`: 72 at a = 0.025 and 5 points).

Many points are judged at once. Each claim runs a closed procedure (a graph of weighted Bonferroni tests, Bretz et
al. 2009). For ``within``, every family starts with an equal share of a = 2.5%, its points tested in a fixed order
from the least compressed budget, each inheriting the level of the one before it once that one is proven; a family
whose points are all proven passes its share on to the others equally. ``beyond`` and ``worse`` treat every point as
a family of its own: Holm's method, which is what the graph is with one point per family. Rejections only grow as
p-values fall, and the error of the whole run is bounded through Ville's inequality at the level each point was ever
tested at, so decisions may be taken at every look (:func:`decide`). The cliffs and the recommendation read the same
decisions and cannot contradict them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # two-sided: each one-sided claim is held at ALPHA / 2, so within and beyond bound a 95% sequence
ONE_SIDED = ALPHA / 2
FRACTIONS = np.sqrt(np.arange(1, 17) / 16)  # the mixture's bets, as shares of the largest safe bet
LARGEST_WEIGHT = 0.15  # of the stake on the largest bet, the rest spread evenly: with three families a point
# identical to full is proven on 110 units rather than 116 (the round of 112 items, not 128), and a point losing 1 of
# 5 points is proven about as often (docs/quality.md)
WEIGHTS = np.full(FRACTIONS.size, (1 - LARGEST_WEIGHT) / FRACTIONS.size) + LARGEST_WEIGHT * (FRACTIONS == 1.0)
CLAIMS = ("within", "beyond", "worse")
ROUND_ITEMS = 16  # items per round of an adaptive sweep: the looks of both the sweep and its simulations
CEILING = 700.0  # log-wealth beyond which exp overflows a float64: see mixture
RUIN = -1e300  # the log-wealth of a bet that lost everything, in the counting path
DISTINCT_FAST = 8  # differences taking at most this many values use the counting path of Wealth
# Verdict codes, as the decisions of one look hold them, and their words
OPEN, WITHIN, BEYOND, WORSE = 0, 1, 2, 3
WORDS = {OPEN: "inconclusive", WITHIN: "within margin", BEYOND: "beyond margin",
         WORSE: "worse, within margin unproven"}
STOPS = {WITHIN: "within", BEYOND: "beyond", WORSE: "worse"}  # why a decided point stopped taking items


@dataclass(frozen=True)
class Claim:
    """One one-sided claim about the mean difference: ``side`` +1 bets that it lies above the null, -1 below; the
    null is minus the margin, or 0 for a claim against full itself (``at_margin`` False)."""

    name: str
    side: int
    at_margin: bool = True

    def null(self, margin: float) -> float:
        return -margin if self.at_margin else 0.0


CLAIM = {"within": Claim("within", 1), "beyond": Claim("beyond", -1), "worse": Claim("worse", -1, False),
         "better": Claim("better", 1, False)}  # better: one configuration above another (the frontier's test)


def log_growth(differences: np.ndarray, null: float, side: int) -> np.ndarray:
    """Each bet's log-growth on each unit, shape ``differences.shape[:-1] + (len(FRACTIONS), n)``: the payoff is
    scaled so that the worst possible unit pays -1, and the largest bet (fraction 1) then loses everything."""
    payoff = side * (np.asarray(differences, dtype=float) - null) / (1 + side * null)
    with np.errstate(divide="ignore"):
        return np.log1p(FRACTIONS[:, None] * payoff[..., None, :])


def mixture(log_bets: np.ndarray) -> np.ndarray:
    """The log of the mixture's wealth (weighted by :data:`WEIGHTS`) from each bet's log-wealth (last axis: the
    bets). Exact wherever a p-value can still matter: a log-wealth above :data:`CEILING` is taken as the ceiling (its
    p-value is below e^-690 either way), and a mixture below e^-745 reads as -inf (its p-value is 1 either way). The
    array given is overwritten."""
    np.minimum(log_bets, CEILING, out=log_bets)
    np.exp(log_bets, out=log_bets)
    with np.errstate(divide="ignore"):
        return np.log(log_bets @ WEIGHTS)


class Wealth:
    """The bets' log-wealth for many sequences of one claim at once (shape ``shape``), advanced a block of units at a
    time: what a sweep keeps per point and what the simulations keep per simulated point, so that both compute the
    same numbers the same way. ``best`` is the largest log-wealth of the mixture reached so far (0 at the start)."""

    def __init__(self, shape: tuple[int, ...], margin: float, claim: str):
        self.rule = CLAIM[claim]
        self.null = self.rule.null(margin)
        self.bets = np.zeros((*shape, FRACTIONS.size))
        self.best = np.zeros(shape)

    @property
    def p(self) -> np.ndarray:
        """The anytime-valid p-value of each sequence: 1 / the largest wealth reached (never above 1)."""
        return np.exp(-self.best)

    def advance(self, differences: np.ndarray, where: tuple[np.ndarray, ...] | None = None) -> None:
        """Take the next units (``differences``: the sequences' shape, or the ``where`` subset's, then the units)."""
        d = np.asarray(differences, dtype=float)
        if d.shape[-1] == 0:
            return
        bets = self.bets if where is None else self.bets[where]
        growth = self._growth(d) + bets[..., None, :]  # (..., units, bets)
        last = growth[..., -1, :].copy()
        reached = np.max(mixture(growth), axis=-1)
        if where is None:
            self.bets, self.best = last, np.maximum(self.best, reached)
        else:
            self.bets[where], self.best[where] = last, np.maximum(self.best[where], reached)

    def _growth(self, d: np.ndarray) -> np.ndarray:
        """Each bet's log-growth summed over the units so far, shape (..., units, bets). Right/wrong outcomes give at
        most three distinct differences: each bet's log-growth is then taken once per value and summed through the
        running count of each (the same sums with far fewer logarithms: what lets the tests simulate ten thousand
        sweeps)."""
        values, codes = np.unique(d, return_inverse=True)
        if values.size > DISTINCT_FAST:
            return np.cumsum(np.moveaxis(log_growth(d, self.null, self.rule.side), -2, -1), axis=-2)
        ruined = np.maximum(log_growth(values, self.null, self.rule.side).T, RUIN)  # (values, bets): finite
        counts = np.cumsum(codes.reshape(d.shape)[..., None] == np.arange(values.size), axis=-2, dtype=float)
        return counts @ ruined


def p_value(differences: Sequence[float] | np.ndarray, margin: float, claim: str) -> float:
    """The anytime-valid p-value of ``claim`` on the units given, in their order (1 with none)."""
    d = np.asarray(differences, dtype=float)
    wealth = Wealth((), margin, claim)
    wealth.advance(d)
    return float(wealth.p)


def fewest_units(margin: float, level: float = ONE_SIDED) -> int:
    """The fewest units any test of a bounded mean needs to prove ``margin`` at ``level`` (module docstring)."""
    return math.floor(math.log(1 / level) / -math.log(1 - margin)) + 1


def claim_p_values(differences: Sequence[np.ndarray], margin: float) -> dict[str, np.ndarray]:
    """Each verdict claim's anytime-valid p-value for each point from its units' differences, shape (1, points):
    what :meth:`Design.look` decides on, in a sweep (one run)."""
    return {claim: np.array([[p_value(d, margin, claim) for d in differences]]) for claim in CLAIMS}


def confidence_bound(differences: Sequence[float], side: int, level: float = ONE_SIDED) -> float:
    """The anytime-valid bound of the mean difference on one side (``side`` +1: the lower bound, -1: the upper):
    the last null that the one-sided test at ``level`` does not reject, found by bisection (a test's wealth falls as
    its null moves towards the data). Units must be given (not empty)."""
    d = np.asarray(differences, dtype=float)

    def rejects(null: float) -> bool:
        growth = np.cumsum(log_growth(d, null, side), axis=-1)
        return float(np.max(mixture(growth.T))) >= math.log(1 / level)

    inside, outside = float(np.mean(d)), -side * 1.0  # the mean is never rejected; beyond -1 (or 1) nothing lies
    if not rejects(outside * (1 - 1e-9)):
        return outside
    for _ in range(30):
        middle = (inside + outside) / 2
        inside, outside = (inside, middle) if rejects(middle) else (middle, outside)
    return inside


def confidence_interval(differences: Sequence[float], level: float = ONE_SIDED) -> tuple[float, float] | None:
    """The anytime-valid interval of the mean difference, each side at ``level`` (None without units)."""
    if len(differences) == 0:
        return None
    return confidence_bound(differences, 1, level), confidence_bound(differences, -1, level)


@dataclass(frozen=True)
class Families:
    """The points judged (by index into the judged list), one tuple per family, least compressed budget first:
    the order ``within`` tests them in. ``beyond`` and ``worse`` test every point on its own (Holm): a family whose
    more compressed point happens to do better must not hide a loss proven at a less compressed one."""

    within: tuple[tuple[int, ...], ...]

    def order(self, claim: str) -> tuple[tuple[int, ...], ...]:
        return self.within if claim == "within" else tuple((i,) for family in self.within for i in family)

    @property
    def points(self) -> int:
        return sum(len(f) for f in self.within)

    @classmethod
    def of(cls, members: Sequence[tuple[str, float | None]]) -> Families:
        """Families from each judged point's (family, budget), in the points' order: a larger budget first (fixed
        before any item is measured, as a fixed sequence must be)."""
        grouped: dict[str, list[tuple[float, int]]] = {}
        for index, (family, budget) in enumerate(members):
            grouped.setdefault(family, []).append((-(budget if budget is not None else math.inf), index))
        return cls(tuple(tuple(i for _, i in sorted(f)) for f in grouped.values()))


def decide(p_values: np.ndarray, families: tuple[tuple[int, ...], ...], level: float = ONE_SIDED
           ) -> tuple[np.ndarray, np.ndarray]:
    """Which hypotheses the closed procedure rejects (module docstring), for p-values of shape (runs, points), and
    the level each rejected one passed at (0 where not rejected); the same code for one run as for many simulated."""
    p = np.atleast_2d(np.asarray(p_values, dtype=float))
    runs = p.shape[0]
    rejected = np.zeros_like(p, dtype=bool)
    passed_at = np.zeros_like(p)
    if not families:
        return rejected, passed_at
    lengths = np.array([len(f) for f in families])
    heads = np.zeros((runs, len(families)), dtype=int)  # how many of each family's points are rejected
    weight = np.full((runs, len(families)), 1.0 / len(families))
    table = np.full((len(families), lengths.max() + 1), -1)
    for f, family in enumerate(families):
        table[f, : len(family)] = family
    rows = np.arange(runs)[:, None]
    for _ in range(p.shape[1]):
        head = table[np.arange(len(families))[None, :], heads]  # (runs, families): each head's index, -1 if done
        head_p = np.where(head >= 0, p[rows, np.maximum(head, 0)], np.inf)
        passes = head_p <= weight * level
        if not passes.any():
            break
        hit_runs, hit_families = np.nonzero(passes)
        rejected[hit_runs, head[hit_runs, hit_families]] = True
        passed_at[hit_runs, head[hit_runs, hit_families]] = weight[hit_runs, hit_families] * level
        heads = heads + passes
        done = heads >= lengths[None, :]
        finished = passes & done  # a family proven to its end passes its weight on, equally
        freed = np.where(finished, weight, 0.0).sum(axis=1, keepdims=True)
        weight = np.where(finished, 0.0, weight)
        still_open = ~done
        share = np.where(still_open.any(axis=1, keepdims=True),
                         freed / np.maximum(1, still_open.sum(axis=1, keepdims=True)), 0.0)
        weight = np.where(still_open, weight + share, weight)
    return rejected, passed_at


@dataclass(frozen=True)
class Look:
    """One look's decisions for every point, shape (runs, points): the verdict code (:data:`WORDS`) and, per
    claim, the level each rejected hypothesis passed at (0: not rejected)."""

    verdicts: np.ndarray
    levels: dict[str, np.ndarray]


@dataclass(frozen=True)
class Design:
    """What is fixed before the first item: the margin (a share: 0.05), the families and their order, the level
    of each claim. Both the sweep (one run) and the simulations (many) decide through :meth:`look`."""

    margin: float
    families: Families
    level: float = ONE_SIDED

    def look(self, p: dict[str, np.ndarray]) -> Look:
        """The decisions at one look from each claim's p-values (runs, points). A point proven beyond the margin is
        ``beyond`` whatever else holds (it can only be within by an error); within the margin beats worse (a loss
        proven smaller than the margin is still within it)."""
        rejected, levels = {}, {}
        for claim in CLAIMS:
            rejected[claim], levels[claim] = decide(p[claim], self.families.order(claim), self.level)
        verdicts = np.select([rejected["beyond"], rejected["within"], rejected["worse"]], [BEYOND, WITHIN, WORSE],
                             OPEN)
        return Look(verdicts, levels)

    def adjusted_p(self, p: dict[str, np.ndarray], claim: str) -> np.ndarray:
        """Each point's adjusted p-value for ``claim`` (one run): the smallest level at which the procedure would
        reject it, found by bisection (rejections only grow with the level)."""
        p_claim = np.atleast_2d(p[claim])
        order = self.families.order(claim)
        adjusted = np.ones(p_claim.shape[1])
        for index in range(p_claim.shape[1]):
            low, high = 0.0, 1.0
            if not decide(p_claim, order, high)[0][0, index]:
                continue
            for _ in range(40):
                middle = (low + high) / 2
                low, high = (low, middle) if decide(p_claim, order, middle)[0][0, index] else (middle, high)
            adjusted[index] = high
        return adjusted


class Allocation:
    """Which points still take items, look after look, for one sweep or many simulated ones (runs, points): a
    point stops at the first look that decides it (within, beyond or worse), and its p-values stay as they were.
    The sweep's rounds (:mod:`kvviz.studies.sweep_rounds`) and the simulations (:mod:`kvviz.studies.simulation`)
    both stop points through :meth:`look`."""

    def __init__(self, design: Design, runs: int = 1):
        self.design = design
        shape = (runs, design.families.points)
        self.open = np.ones(shape, dtype=bool)
        self.stops = np.full(shape, OPEN)  # the verdict a point stopped on (OPEN: still taking items, or capped)
        self.stopped_at = np.full(shape, -1)  # the look it stopped at (counted from 0)
        self.looks = 0
        self.last: Look | None = None

    def look(self, p: dict[str, np.ndarray]) -> Look:
        """Decide on every point's p-values now (stopped points' as they were when they stopped)."""
        look = self.design.look(p)
        newly = self.open & (look.verdicts != OPEN)
        self.stops[newly] = look.verdicts[newly]
        self.stopped_at[newly] = self.looks
        self.open &= ~newly
        self.looks += 1
        self.last = look
        return look
