"""Judging a configuration against full on the same items: units (items, or documents), the worked examples of
docs/quality.md, verdicts in four words, cliffs and the recommendation read from the same decisions, the margin
fixed before the run, and the plan as a power calculation."""

import numpy as np
import pytest

from kvviz.studies.intervals import wilson
from kvviz.studies.paired import (
    INCONCLUSIVE,
    VERDICT_BEYOND,
    VERDICT_WITHIN,
    VERDICT_WORSE,
    newcombe_lower,
    unit_differences,
)
from kvviz.studies.power import plan
from kvviz.studies.sweep import Family, SweepPoint, SweepReport
from kvviz.studies.sweep_measure import Outcome
from kvviz.studies.verdicts import judged_report


def test_newcombe_matches_the_published_paired_example():
    # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), ch. 8: complete response before
    # and after consolidation therapy (Cavo et al. 2012), [[59, 6], [16, 80]]: estimate -0.0621, 95% CI -0.1186 to
    # -0.0046 by Newcombe's square-and-add (hybrid score) interval. Rows are "ours", columns "full".
    assert round(float(newcombe_lower(59, 16, 6, 80)), 4) == -0.1186


def test_groups_are_the_units_their_difference_the_mean_over_their_items():
    differences = unit_differences([1, 1, 1, 0], [0, 1, 1, 1], ["a", "a", "b", "b"])
    assert differences.tolist() == [-0.5, 0.5]
    assert unit_differences([1, 0], [0, 0]).tolist() == [-1.0, 0.0]


def report_of(per_spec: dict[str, list[bool]], groups: list[str] | None = None, margin: float = 5.0,
              family: str = "f") -> SweepReport:
    """A measured task sweep from outcomes alone: SPEC (full, then ``f:COMPRESSION``) -> right per item."""
    items = len(per_spec["full"])
    points = []
    for spec, right in per_spec.items():
        compression = 1.0 if spec == "full" else float(spec.split(":")[1])
        point = SweepPoint(spec, "full" if spec == "full" else spec.split(":")[0],
                           "fixed" if spec == "full" else "eviction", None if spec == "full" else 1 / compression,
                           kv_bytes=round(1000 / compression), kv_bytes_full=1000)
        point.outcomes = [Outcome(f"i{k}", r) for k, r in enumerate(right)]
        point.accuracy, point.accuracy_ci, point.items_scored = sum(right) / len(right), wilson(sum(right),
                                                                                               len(right)), len(right)
        points.append(point)
    families = [Family(name, name, ("budget",), "eviction") for name in dict.fromkeys(p.family for p in points[1:])]
    report = SweepReport("m", f"{items} items", "task", 100, [0.25], families, points, ["accuracy"], 0.0,
                         items=[{"id": f"i{k}"} for k in range(items)], groups=groups, margin=margin,
                         margin_fixed=margin)
    return judged_report(report, margin, 0.9)


def shuffled(items: int, full_right: int, lost: int, gained: int = 0, seed: int = 0) -> tuple[list, list]:
    """Full's and a configuration's outcomes on ``items`` items, in a random order (as a seed's items come)."""
    full = [True] * full_right + [False] * (items - full_right)
    ours = list(full)
    for k in range(lost):
        ours[k] = False
    for k in range(gained):
        ours[items - 1 - k] = True
    order = np.random.default_rng(seed).permutation(items)
    return [full[i] for i in order], [ours[i] for i in order]


@pytest.mark.parametrize("items, full_right, lost, gained, text, verdict", [
    (32, 32, 6, 0, "-18.8 points [-44.0, +0.5]", INCONCLUSIVE),
    (32, 24, 0, 0, "+0.0 points [-12.9, +12.9]", INCONCLUSIVE),
    (72, 72, 0, 0, "+0.0 points [-6.0, +6.0]", INCONCLUSIVE),
    (128, 96, 0, 0, "+0.0 points [-3.4, +3.4]", VERDICT_WITHIN),
    (200, 150, 1, 0, "-0.5 points [-3.7, +1.8]", VERDICT_WITHIN),
    (300, 225, 9, 0, "-3.0 points [-6.8, -0.7]", VERDICT_WORSE),
    (200, 150, 30, 0, "-15.0 points [-22.9, -9.3]", VERDICT_BEYOND),
])
def test_the_worked_examples_of_quality_md(items, full_right, lost, gained, text, verdict):
    full, ours = shuffled(items, full_right, lost, gained)
    paired = report_of({"full": full, "f:2": ours}).points[1].paired
    assert (paired.interval_text(), paired.verdict) == (text, verdict)
    assert (paired.lost, paired.gained, paired.items, paired.units) == (lost, gained, items, items)


def test_too_few_units_say_how_many_any_test_needs():
    paired = report_of({"full": [True] * 32, "f:2": [True] * 32}).points[1].paired
    assert paired.describe() == "is inconclusive: 32 items cannot prove the margin, however alike (at least 72 can)"


def test_two_documents_prove_nothing_however_many_items_they_hold():
    """The review found `worse` declared from two documents when McNemar counted items: units are documents now."""
    groups = ["a"] * 20 + ["b"] * 20
    paired = report_of({"full": [True] * 40, "f:2": [False] * 40}, groups).points[1].paired
    assert (paired.items, paired.units, paired.verdict) == (40, 2, INCONCLUSIVE)
    assert paired.p_value > 0.2
    alone = report_of({"full": [True] * 40, "f:2": [False] * 40}).points[1].paired
    assert alone.verdict == VERDICT_BEYOND


def test_the_cliffs_and_the_recommendation_read_the_same_decisions():
    full, _ = shuffled(400, 300, 0)
    one_lost = [False] + full[1:] if full[0] else [not full[0]] + full[1:]
    many_lost = [False if k % 4 == 0 else v for k, v in enumerate(full)]
    report = report_of({"full": full, "f:2": full, "f:4": one_lost, "f:8": many_lost,
                        "g:3": full, "g:6": many_lost})
    verdicts = {p.spec: p.paired.verdict for p in report.points[1:]}
    assert verdicts["f:2"] == verdicts["f:4"] == verdicts["g:3"] == VERDICT_WITHIN
    assert verdicts["f:8"] == verdicts["g:6"] == VERDICT_BEYOND
    assert report.cliffs["f"].spec == "f:4" and report.cliffs["g"].spec == "g:3"
    summary = " ".join(report.summary)
    assert "Deploy f:4: 4.0x smaller than full and proven within 5 points" in summary
    assert "across 5 configurations in 2 families" in summary
    assert "2 are proven below full, 2 of them beyond the margin" in summary
    for point in report.points[1:]:  # every within verdict's adjusted p passed, every other's did not
        assert (point.paired.verdict == VERDICT_WITHIN) == (point.paired.margin_p_adjusted <= 0.025)


def test_a_cliff_stops_at_the_first_budget_not_proven_whatever_lies_beyond():
    full, _ = shuffled(400, 300, 0)
    many_lost = [False if k % 4 == 0 else v for k, v in enumerate(full)]
    report = report_of({"full": full, "f:2": many_lost, "f:4": full})
    assert report.points[2].paired.verdict != VERDICT_WITHIN, "the procedure never reaches f:4 for within"
    cliff = report.cliffs["f"]
    assert cliff.spec is None and cliff.past == "f:2" and "beyond the margin" in cliff.sentence()


def test_a_margin_changed_after_the_run_is_exploratory():
    full, ours = shuffled(200, 150, 1)
    report = report_of({"full": full, "f:2": ours})
    assert not report.points[1].paired.exploratory and report.to_json()["exploratory"] is False
    moved = judged_report(report, 3.0, 0.9)
    assert moved.points[1].paired.exploratory and moved.to_json()["exploratory"] is True
    assert moved.summary[0].startswith("Exploratory: the margin was fixed at 5 points before this run; read at 3")
    with pytest.raises(ValueError, match="a margin of 100 points is not a loss between 0 and 100"):
        judged_report(report, 100.0, 0.9)
    with pytest.raises(ValueError, match="a margin of 0 points"):
        judged_report(report, 0.0, 0.9)


def test_the_plan_is_a_power_calculation_of_the_design():
    fixed = plan(32, 5.0, 3)
    assert fixed.fewest_items == 94 and "however alike: it takes at least 94" in fixed.sentence()
    assert all(row.within.share == 0 for row in fixed.rows)
    adaptive = plan(256, 5.0, 3, adaptive=True)
    by_loss = {row.loss_points: row for row in adaptive.rows}
    assert by_loss[0.0].within.share > 0.95 and 96 <= by_loss[0.0].median_items <= 160
    assert by_loss[10.0].loss_proven.share > 0.95
    assert by_loss[0.0].within.share > by_loss[1.0].within.share > by_loss[2.5].within.share
    assert "Adaptive, up to 256 items in rounds of 16, 3 families" in adaptive.sentence()
    with pytest.raises(ValueError, match="a margin of 0 points"):
        plan(32, 0.0)


def test_the_verdicts_find_full_by_its_spec_not_by_its_place():
    """Full is found in one place (verdicts.full_point, which SweepReport.full reads): a report whose points list
    full second judges every point as the one that lists it first."""
    full, ours = shuffled(200, 150, 30)
    first = report_of({"full": full, "f:2": ours, "f:4": ours})
    moved = report_of({"f:2": ours, "full": full, "f:4": ours})
    assert moved.full is moved.points[1] and moved.full.paired is None
    by_spec = {p.spec: p for p in moved.points}
    for point in first.points[1:]:
        assert by_spec[point.spec].paired.verdict == point.paired.verdict
    assert moved.summary == first.summary
