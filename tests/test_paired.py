"""Judging a configuration against full on the same items: Newcombe's paired interval, the exact McNemar test,
Holm's adjustment, verdicts against a margin, cliffs that are proofs, and the plan of a run."""

import random

import pytest

from kvviz.studies.paired import (
    INCONCLUSIVE,
    WITHIN,
    WORSE,
    Table,
    holm,
    margin_p_binary,
    mcnemar_exact,
    newcombe_paired,
    paired_binary,
    paired_mean,
    units_to_prove,
)
from kvviz.studies.power import detectable_loss, items_for_margin, plan, power_against
from kvviz.studies.verdicts import find_cliff


def test_newcombe_matches_the_published_paired_example():
    # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), ch. 8: complete response before
    # and after consolidation therapy (Cavo et al. 2012), [[59, 6], [16, 80]]: estimate -0.0621, 95% CI -0.1186 to
    # -0.0046 by Newcombe's square-and-add (hybrid score) interval. Rows are "ours", columns "full".
    low, high = newcombe_paired(Table(both_right=59, lost=16, gained=6, both_wrong=80))
    assert (round(low, 4), round(high, 4)) == (-0.1186, -0.0046)
    assert newcombe_paired(Table(59, 6, 16, 80)) == pytest.approx((0.0046, 0.1186), abs=1e-4), "swapped: mirrored"
    assert newcombe_paired(Table(0, 0, 0, 0)) is None


def test_exact_mcnemar_values():
    assert mcnemar_exact(6, 0) == pytest.approx(0.03125)  # 2 / 2^6
    assert mcnemar_exact(5, 0) == pytest.approx(0.0625)
    assert mcnemar_exact(16, 6) == pytest.approx(2 * 110056 / 2 ** 22)  # P(X <= 6 | 22, 1/2) summed by hand
    assert mcnemar_exact(2, 2) == 1.0 and mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 4) == 1.0


def test_holm_adjusts_step_down_and_keeps_order():
    assert holm([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])
    assert holm([0.5, 0.5]) == [1.0, 1.0] and holm([]) == []


def test_six_lost_and_none_gained_of_32_is_worse():
    judged = paired_binary([True] * 32, [True] * 26 + [False] * 6, margin_points=5)
    assert (judged.lost, judged.gained, judged.verdict) == (6, 0, WORSE)
    assert judged.p_value == pytest.approx(0.031, abs=5e-4) and judged.difference == pytest.approx(-6 / 32)
    assert judged.difference_ci[1] < 0 and "worse" in judged.describe()


def test_losses_and_gains_that_cancel_are_never_worse():
    full = [True, True, False, False] + [True] * 28
    ours = [False, False, True, True] + [True] * 28
    judged = paired_binary(full, ours, margin_points=5)
    assert (judged.lost, judged.gained, judged.difference, judged.p_value) == (2, 2, 0.0, 1.0)
    assert judged.verdict != WORSE and judged.difference_ci[0] < 0 < judged.difference_ci[1]


def test_three_right_of_eight_is_inconclusive_never_within_the_margin():
    judged = paired_binary([True] * 8, [True] * 3 + [False] * 5, margin_points=5)
    assert judged.verdict == INCONCLUSIVE, "the exact test does not reject 5 lost of 8 (p = 0.0625)"
    assert judged.hidden_loss > 80 and judged.describe().startswith("could hide a loss of up to 86 points")
    for margin in (5, 20, 50):
        assert paired_binary([True] * 8, [True] * 8, margin).verdict != WITHIN or margin >= 50, \
            "even 8 of 8 proves only a very wide margin"


def test_a_point_is_within_the_margin_only_when_the_interval_proves_it():
    full = [True] * 150 + [False] * 50
    same = paired_binary(full, full, margin_points=5)
    assert same.verdict == WITHIN and same.margin_p < 0.025
    one_lost = paired_binary(full, [False] + full[1:], margin_points=5)
    assert one_lost.verdict == WITHIN and one_lost.margin_p > same.margin_p
    many_lost = paired_binary(full, [False] * 20 + full[20:], margin_points=5)
    assert many_lost.verdict == WORSE and margin_p_binary(Table(130, 20, 0, 50), 5) == 1.0


def test_agreement_is_judged_on_each_prompts_loss_against_full():
    three_broken = [-1.0] * 3 + [0.0] * 29  # 3 of 32 prompts at 0% agreement
    assert paired_mean(three_broken, margin_points=2).verdict != WITHIN
    four_slight = [-0.01] * 4 + [0.0] * 196  # 4 of 200 prompts at 99%
    judged = paired_mean(four_slight, margin_points=2)
    assert judged.verdict == WITHIN and judged.lost == 4 and judged.p_value is None
    assert paired_mean(four_slight[:32], margin_points=2).units_needed == 183, "32 prompts cannot prove 2 points"


def test_a_few_alike_prompts_cannot_prove_a_margin_whatever_the_bootstrap_says():
    """Three lossless prompts: the bootstrap's interval is [0, 0], yet a mean loss of 5 points (one prompt in twenty
    broken) leaves three prompts lossless 86% of the time."""
    few = paired_mean([0.0] * 3, margin_points=5)
    assert few.difference_ci == (0.0, 0.0) and few.verdict == INCONCLUSIVE
    assert few.margin_p == pytest.approx(0.95 ** 3) and few.units_needed == units_to_prove(5) == 72
    assert "3 items cannot prove the margin" in few.describe()
    assert paired_mean([0.0] * 72, 5).verdict == WITHIN and paired_mean([0.0] * 71, 5).verdict == INCONCLUSIVE
    documents = [f"doc{i % 10}" for i in range(100)]
    assert paired_mean([0.0] * 100, 5, groups=documents).units_needed == 72, "ten documents are ten units"
    assert paired_binary([True] * 100, [True] * 100, 5, groups=documents).verdict == INCONCLUSIVE
    assert paired_binary([True] * 100, [True] * 100, 5).verdict == WITHIN, "Newcombe's interval counts items"


def test_groups_widen_the_interval_of_prompts_sharing_a_document():
    differences = [-1.0, -1.0, -1.0, -1.0] + [0.0] * 28  # the four losses all from one document
    alone = paired_mean(differences, 5)
    grouped = paired_mean(differences, 5, groups=["doc0"] * 4 + [f"doc{i}" for i in range(1, 29)])
    assert grouped.difference == alone.difference
    assert grouped.difference_ci[0] < alone.difference_ci[0], "one document's failures are one draw, not four"


def _family(outcomes_full: list[bool], per_budget: dict[float, list[bool]], margin: float):
    return [(f"f:{compression}", compression, paired_binary(outcomes_full, outcomes, margin))
            for compression, outcomes in per_budget.items()]


def test_a_cliff_walks_from_the_least_compressed_and_stops_at_the_first_unproven():
    full = [True] * 150 + [False] * 50
    per_budget = {2.0: full, 4.0: [False] + full[1:], 8.0: [False] * 30 + full[30:], 16.0: full}
    cliff = find_cliff("f", _family(full, per_budget, 5), 5)
    assert (cliff.spec, cliff.past) == ("f:4.0", "f:8.0"), "16x, past the fall, does not move it"
    sentence = cliff.sentence()
    assert "proven within 5 points of full up to 4.0x" in sentence and "it is worse than full" in sentence
    none = find_cliff("f", _family(full[:8], {2.0: full[:8]}, 5), 5, items_needed=73)
    assert none.spec is None and "takes at least 73 items" in none.sentence()
    assert find_cliff("f", [("a", 2.0, None)], 5) is None


@pytest.mark.parametrize("seed", range(8))
def test_fewer_items_never_move_a_cliff_to_a_higher_compression(seed):
    rng = random.Random(seed)
    full = [rng.random() < 0.8 for _ in range(128)]
    loss_rates = {2.0: 0.0, 4.0: 0.01, 8.0: 0.05, 16.0: 0.3, 32.0: 0.6}
    per_budget = {c: [f and rng.random() >= rate for f in full] for c, rate in loss_rates.items()}
    reached = []
    for n in (128, 64, 32, 16, 8):  # the same outcomes, fewer of them
        cliff = find_cliff("f", _family(full[:n], {c: o[:n] for c, o in per_budget.items()}, 5), 5)
        reached.append(cliff.compression or 0.0)
    assert reached == sorted(reached, reverse=True), reached
    assert reached[0] >= 2.0 and reached[-1] == 0.0, "128 items prove the lossless point, 8 prove nothing"


def test_the_plan_says_what_a_run_can_detect_and_prove():
    assert detectable_loss(5) is None, "the exact test needs six lost items"
    loss = detectable_loss(32)
    assert power_against(32, loss) == pytest.approx(0.8, abs=1e-6) and 0.2 < loss < 0.3
    assert detectable_loss(128) < detectable_loss(64) < loss
    needed = items_for_margin(5)
    assert newcombe_paired(Table(needed, 0, 0, 0))[0] > -0.05 >= newcombe_paired(Table(needed - 1, 0, 0, 0))[0]
    planned = plan(32, 5)
    assert planned.items_for_margin == needed and f"takes at least {needed} items" in planned.sentence()
    assert set(planned.to_json()) == {"items", "margin", "detectable_loss", "items_for_margin", "assumptions"}
