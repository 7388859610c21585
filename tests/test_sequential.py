"""The anytime-valid tests and the closed procedure the verdicts rest on: the betting wealth, its bounds, the order
of each family's tests, Holm's method as the one-point-per-family case, adjusted p-values and the stopping rule."""

import math

import numpy as np
import pytest

from kvviz.studies.sequential import (
    BEYOND,
    CLAIMS,
    FRACTIONS,
    LARGEST_WEIGHT,
    ONE_SIDED,
    OPEN,
    WEIGHTS,
    WITHIN,
    WORSE,
    Allocation,
    Design,
    Families,
    Wealth,
    claim_p_values,
    confidence_interval,
    decide,
    fewest_units,
    log_growth,
    mixture,
    p_value,
)


def test_the_counting_path_gives_the_wealth_of_the_unit_by_unit_sum():
    rng = np.random.default_rng(1)
    d = rng.choice([-1.0, 0.0, 1.0], size=(20, 2, 150), p=[0.1, 0.8, 0.1])
    for claim in CLAIMS:
        wealth = Wealth(d.shape[:2], 0.05, claim)
        wealth.advance(d[..., :70])
        wealth.advance(d[..., 70:])  # two blocks, as two rounds: the same as one
        rule_null = -0.05 if claim != "worse" else 0.0
        side = 1 if claim == "within" else -1
        growth = np.cumsum(np.moveaxis(log_growth(d, rule_null, side), -2, -1), axis=-2)
        best = np.maximum(0.0, np.max(mixture(growth), axis=-1))
        assert np.allclose(wealth.best, best, atol=1e-9)
    continuous = np.linspace(-1, 1, 40)
    assert p_value(continuous, 0.05, "within") == pytest.approx(p_value(list(continuous), 0.05, "within"))
    assert p_value([], 0.05, "within") == 1.0


def test_no_test_proves_a_margin_on_fewer_units_than_a_bounded_mean_allows():
    # 5 points at 2.5%: (0.95)^72 = 2.5% exactly at the edge; the largest bet on 71 lossless units cannot reach 40
    assert fewest_units(0.05) == 72 and fewest_units(0.02) == 183 and fewest_units(0.05, 0.025 / 3) == 94
    for units in (10, 40, 71):
        assert p_value(np.zeros(units), 0.05, "within") > 0.025
    assert math.exp(-units * math.log(1 / 0.95)) > 0.025
    assert p_value(np.zeros(200), 0.05, "within") < 0.001
    assert FRACTIONS.max() == 1.0, "the mixture holds the largest safe bet, which reaches the bound"


def test_the_stake_on_the_largest_bet_proves_a_point_identical_to_full_in_the_round_of_112():
    """Three families share 2.5%: a point identical to full is proven within 5 points on 110 units, not the 116 an
    even mixture needs, so an adaptive sweep proves it at the look after 112 items rather than 128."""
    assert WEIGHTS.sum() == pytest.approx(1.0) and WEIGHTS.min() > 0, "a mixture: any fixed weights keep the level"
    assert WEIGHTS[FRACTIONS == 1.0][0] == pytest.approx(LARGEST_WEIGHT + (1 - LARGEST_WEIGHT) / FRACTIONS.size)
    level = ONE_SIDED / 3
    assert p_value(np.zeros(109), 0.05, "within") > level >= p_value(np.zeros(110), 0.05, "within")
    even = np.exp(np.cumsum(log_growth(np.zeros(116), -0.05, 1), axis=-1)).mean(axis=0)  # the mixture before
    assert even[-2] < 1 / level <= even[-1], "an even mixture needs 116 units"


def test_the_interval_holds_the_mean_and_narrows_with_units():
    d = np.random.default_rng(0).permutation(np.r_[np.zeros(90), -np.ones(10)])  # units in no order, as drawn
    low, high = confidence_interval(d)
    assert low < -0.1 < high
    wider = confidence_interval(d[::2])
    assert wider[0] < low and wider[1] > high
    assert confidence_interval([]) is None


def _holm(p: list[float], level: float) -> list[bool]:
    order = np.argsort(p)
    rejected = [False] * len(p)
    for rank, index in enumerate(order):
        if p[index] > level / (len(p) - rank):
            break
        rejected[index] = True
    return rejected


def test_with_one_point_per_family_the_procedure_is_holm():
    rng = np.random.default_rng(3)
    for _ in range(300):
        p = rng.uniform(0, 0.05, size=4) ** rng.uniform(0.5, 2)
        rejected, _ = decide(p[None, :], tuple((i,) for i in range(4)), 0.025)
        assert list(rejected[0]) == _holm(list(p), 0.025)


def test_a_family_is_tested_in_order_and_passes_its_level_on_when_it_is_proven_to_its_end():
    families = ((0, 1), (2,))
    rejected, levels = decide(np.array([[0.5, 0.001, 0.001]]), families, 0.025)
    assert list(rejected[0]) == [False, False, True], "the second point waits for the first"
    rejected, levels = decide(np.array([[0.01, 0.012, 0.02]]), families, 0.025)
    assert list(rejected[0]) == [True, True, True]
    assert levels[0].tolist() == pytest.approx([0.0125, 0.0125, 0.025]), "a family proven to its end passes it on"


def test_adjusted_p_values_agree_with_the_decisions_at_every_level():
    design = Design(0.05, Families(((0, 1), (2,), (3, 4))))
    rng = np.random.default_rng(5)
    for _ in range(20):
        p = {claim: rng.uniform(0, 0.04, size=(1, 5)) for claim in CLAIMS}
        adjusted = design.adjusted_p(p, "within")
        for level in (0.005, 0.01, 0.025):
            rejected, _ = decide(p["within"], design.families.order("within"), level)
            assert list(rejected[0]) == [a <= level for a in adjusted]


def test_a_look_says_within_over_worse_and_beyond_over_everything():
    design = Design(0.05, Families(((0,), (1,), (2,))))
    tiny, large = 1e-6, 1.0
    look = design.look({"within": np.array([[tiny, large, large]]), "beyond": np.array([[large, tiny, large]]),
                        "worse": np.array([[tiny, tiny, large]])})
    assert look.verdicts[0].tolist() == [WITHIN, BEYOND, OPEN]
    look = design.look({"within": np.array([[large, large, large]]), "beyond": np.array([[large] * 3]),
                        "worse": np.array([[tiny, large, large]])})
    assert look.verdicts[0].tolist() == [WORSE, OPEN, OPEN]


def test_a_decided_point_stops_and_its_p_values_stay_as_they_were():
    design = Design(0.05, Families(((0,), (1,))))
    allocation = Allocation(design)
    lossless, losing = np.zeros(16), -np.ones(16)
    differences = [lossless, losing]
    for _ in range(12):
        allocation.look(claim_p_values(differences, 0.05))
        differences = [d if not allocation.open[0, j] else np.r_[d, d[:16]] for j, d in enumerate(differences)]
    assert allocation.stops[0].tolist() == [WITHIN, BEYOND]
    assert allocation.stopped_at[0, 1] == 0, "sixteen losses prove beyond at the first look"
    assert len(differences[1]) == 16 and len(differences[0]) > 72
    assert not allocation.open.any()
