"""A sweep's verdicts: every point judged against full on the same items, each family's cliff, and a recommendation
that is a proof, not a best point estimate.

The rules (docs/quality.md works them through):

- **paired**: each point against full over the same units (items, or groups of items sharing a document), its
  difference with an anytime-valid 95% interval (:mod:`kvviz.studies.paired`);
- **verdicts**: three one-sided claims per point (within the margin, beyond it, below full), each an anytime-valid
  test held at 2.5% across every point of the sweep by one closed procedure (:mod:`kvviz.studies.sequential`), so
  a verdict stays valid however early its point stopped taking items;
- **cliff**: walking a family from its least compressed budget (the order the procedure tests ``within`` in), the
  last point proven within the margin before the first that is not;
- **recommendation**: the most compressed point proven within the margin by the same decisions: cliffs and the
  recommendation read one set of decisions and cannot contradict each other;
- **margin**: fixed before the run and stored with it; read at another margin afterwards, every verdict is labelled
  exploratory;
- **frontier**: a point is dominated only by one with no more bytes that is proven better on the same units;
- **memory**: compressions, and so the frontier, the cliffs and the recommendation, count the bytes kvviz holds or
  what a serving layout would hold for the same kept tokens (:mod:`kvviz.cache.layouts`); the verdicts against full
  do not depend on memory;
- **tail** (prompt sets): the share of prompts whose agreement with full falls below a threshold, a Wilson interval
  beside it, judged against full (which never falls below) like accuracy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvviz.cache.layouts import LABELS, compression_in
from kvviz.studies.frontier import MEASURES, Measure, on_frontier
from kvviz.studies.intervals import bootstrap_mean, wilson
from kvviz.studies.paired import (
    BELOW_FULL,
    INCONCLUSIVE,
    VERDICT_BEYOND,
    VERDICT_WITHIN,
    Paired,
    unit_differences,
)
from kvviz.studies.power import plan
from kvviz.studies.sequential import (
    BEYOND,
    CLAIMS,
    ONE_SIDED,
    WITHIN,
    WORDS,
    WORSE,
    Design,
    Families,
    claim_p_values,
    confidence_bound,
    confidence_interval,
    fewest_units,
    p_value,
)

DEFAULT_TAIL_THRESHOLD = 0.9  # a prompt whose agreement with full falls below 90% counts in the tail


def outcome_values(outcomes: Sequence, measure_key: str, threshold: float) -> list | None:
    """The per-item values a paired comparison reads on a measure: right/wrong (accuracy), the prompt held at or
    above the threshold (the tail), agreement with full, mean KL; None when an outcome lacks it."""
    if measure_key == "accuracy":
        values = [o.correct for o in outcomes]
    elif measure_key == "tail_share":
        values = [None if o.agreement is None else o.agreement >= threshold for o in outcomes]
    elif measure_key in ("agreement_with_full", "mean_kl"):
        values = [o.agreement if measure_key == "agreement_with_full" else o.mean_kl for o in outcomes]
    else:
        return None
    return None if any(v is None for v in values) else values


def item_values(point, measure: Measure, threshold: float) -> list | None:
    """A point's per-item values on ``measure`` (:func:`outcome_values`); None when it failed or has none."""
    if point.error is not None or not point.outcomes:
        return None
    return outcome_values(point.outcomes, measure.key, threshold)


def fill_tail(points: Sequence, threshold: float, groups: list[str] | None) -> None:
    """Each prompt-set point's share of prompts below ``threshold`` agreement and its 95% interval."""
    for point in points:
        if point.error is not None or not point.outcomes or point.outcomes[0].agreement is None:
            continue
        below = [o.agreement < threshold for o in point.outcomes]
        point.tail_share = sum(below) / len(below)
        point.tail_ci = (wilson(sum(below), len(below)) if groups is None else
                         bootstrap_mean([float(b) for b in below], groups[:len(below)]))


def sweep_design(points: Sequence, judged: Sequence[int], margin: float) -> Design:
    """The design of the points at ``judged`` (indices into ``points``): their families in budget order."""
    return Design(margin / 100, Families.of([(points[i].family, points[i].budget) for i in judged]))


def full_point(points: Sequence):
    """The full cache's point among ``points``, every other point's reference (None where it failed to run): the
    one place a sweep finds it (:attr:`kvviz.studies.sweep.SweepReport.full` reads it here too)."""
    return next((p for p in points if p.spec == "full"), None)


def judge(points: Sequence, measure: Measure, margin: float, threshold: float, groups: list[str] | None,
          exploratory: bool = False) -> list[Paired | None]:
    """Each point against full on ``measure``, all decided at once by the sweep's closed procedure
    (:mod:`kvviz.studies.sequential`); full and points without items get None. A point that ran fewer items than
    full (an adaptive sweep stopped it) is paired on the items it ran."""
    judged: list[Paired | None] = [None] * len(points)
    reference = full_point(points)
    full = None if reference is None else item_values(reference, measure, threshold)
    if full is None or measure.paired is None:
        return judged
    found = [(i, item_values(p, measure, threshold)) for i, p in enumerate(points) if p is not reference]
    found = [(i, v) for i, v in found if v is not None]
    if not found:
        return judged
    indices = [i for i, _ in found]
    differences = [unit_differences(full[:len(v)], v, None if groups is None else groups[:len(v)]) for _, v in found]
    design = sweep_design(points, indices, margin)
    p = claim_p_values(differences, margin / 100)
    look = design.look(p)
    adjusted = {claim: design.adjusted_p(p, claim) for claim in CLAIMS}
    needed = fewest_units(margin / 100, ONE_SIDED / len(design.families.within))
    for j, ((index, values), d) in enumerate(zip(found, differences, strict=True)):
        code = int(look.verdicts[0, j])
        items = np.asarray(values, dtype=float) - np.asarray(full[:len(values)], dtype=float)
        claim = {WITHIN: "within", BEYOND: "beyond", WORSE: "worse"}.get(code)
        level = None if claim is None else float(look.levels[claim][0, j])
        judged[index] = Paired(
            len(values), len(d), int(np.count_nonzero(items < 0)), int(np.count_nonzero(items > 0)), float(np.mean(d)),
            confidence_interval(d), float(p["worse"][0, j]), float(p["within"][0, j]), float(p["beyond"][0, j]),
            WORDS[code], margin, float(adjusted["worse"][j]), float(adjusted["within"][j]),
            float(adjusted["beyond"][j]), None if claim is None else confidence_bound(d, 1 if code == WITHIN else -1,
                                                                                     level),
            level, needed if code not in (WITHIN, BEYOND, WORSE) and len(d) < needed else None, exploratory)
    return judged


def significantly_better(ours: list, theirs: list, measure: Measure, groups: list[str] | None) -> bool:
    """Whether ``ours`` beats ``theirs`` on the units both ran: the betting test of a positive mean difference at
    2.5% for a bounded per-item value (right/wrong, agreement), the bootstrap interval over units for an unbounded
    one (KL), whose values lower is better."""
    count = min(len(ours), len(theirs))
    shared = None if groups is None else groups[:count]
    if measure.key == "mean_kl":
        interval = bootstrap_mean([t - o for o, t in zip(ours[:count], theirs[:count], strict=True)], shared)
        return interval is not None and interval[0] > 0
    d = unit_differences(theirs[:count], ours[:count], shared)
    return bool(np.mean(d) > 0) and p_value(d, 0.0, "better") <= ONE_SIDED


def held_bytes(point, layout: str = "counted") -> float | None:
    """A point's memory: the bytes kvviz counts, or what serving ``layout`` would hold for the same kept tokens
    (:mod:`kvviz.cache.layouts`; None where the point has no ledger to lay out)."""
    return point.kv_bytes if layout == "counted" else (point.layout_bytes or {}).get(layout)


def compression_of(point, full, layout: str = "counted") -> float | None:
    """How many times smaller than ``full`` a point is: in the bytes kvviz counts, or in what serving ``layout``
    would hold for the same kept tokens (None where either has no ledger to lay out)."""
    if layout == "counted":
        return point.compression
    return compression_in(layout, point.layout_bytes, None if full is None else full.layout_bytes)


def smaller_than_full(compression: float, layout: str) -> str:
    """"4.0x smaller than full", naming the layout whose bytes were counted where it is not kvviz's own."""
    return f"{compression:.1f}x smaller than full" + ("" if layout == "counted" else f" ({LABELS[layout]})")


def frontier_flags(points: Sequence, measure: Measure, threshold: float, groups: list[str] | None,
                   layout: str = "counted") -> list[bool]:
    """Which points are on ``measure``'s frontier (:func:`kvviz.studies.frontier.on_frontier`) with memory counted
    in ``layout``, dominance read from paired comparisons where the measure has items, from point estimates where it
    has none."""
    values = [getattr(p, measure.key) for p in points]
    pairs = [(held_bytes(p, layout), v) for p, v in zip(points, values, strict=True)]
    items = [item_values(p, measure, threshold) for p in points]
    if any(v is not None and i is None for v, i in zip(values, items, strict=True)):
        return on_frontier(pairs, measure)  # no items to pair (one play's perplexity): point estimates

    def beats(i: int, j: int) -> bool:
        # only a better point estimate can be significantly better: skip the test otherwise
        return measure.better(values[i], values[j]) and significantly_better(items[i], items[j], measure, groups)

    return on_frontier(pairs, measure, beats)


@dataclass(frozen=True)
class Cliff:
    """Where a family falls off on a measure: ``spec`` its most compressed point proven within the margin, walking
    from its least compressed budget (None: not even that one); ``past`` the first point that is not, and its
    verdict in words (None: every point measured is proven). ``items_needed``: how many items proving the margin
    would take at the least, said when nothing is proven and the run had fewer."""

    family: str
    spec: str | None
    compression: float | None
    past: str | None = None
    past_compression: float | None = None
    past_verdict: str | None = None
    margin: float = 0.0
    items_needed: int | None = None
    layout: str = "counted"  # whose bytes the compressions count

    def sentence(self) -> str:
        margin = f"within {self.margin:g} points of full"
        memory = "" if self.layout == "counted" else f" Compressions count what {LABELS[self.layout]} would hold."
        if self.spec is None:
            needed = f"; proving it takes at least {self.items_needed:,} items" if self.items_needed else ""
            return (f"{self.family}: no point is proven {margin}; its least compressed, {self.past_compression:.1f}x "
                    f"({self.past}), {self.past_verdict}{needed}.{memory}")
        if self.past is None:
            return (f"{self.family} is proven {margin} at every budget measured, up to {self.compression:.1f}x "
                    f"({self.spec}).{memory}")
        return (f"{self.family}'s cliff: proven {margin} up to {self.compression:.1f}x ({self.spec}); at "
                f"{self.past_compression:.1f}x ({self.past}) it {self.past_verdict}.{memory}")


def find_cliff(family: str, members: Sequence[tuple[str, float, Paired | None]], margin: float,
               items_needed: int | None = None, layout: str = "counted") -> Cliff | None:
    """The cliff of a family from its points (SPEC, compression, judgement against full) listed least compressed
    budget first, None when some point was not judged. The walk stops at the first point not proven within the
    margin (the procedure tests a family's points in this order, so none beyond it is proven); the cliff is the most
    compressed point proven before it (a serving layout may free less for a smaller budget)."""
    if not members or any(paired is None for _, _, paired in members):
        return None
    held: tuple[str, float] | None = None  # the most compressed point proven so far (in the layout's bytes)
    for spec, compression, paired in members:
        if paired.verdict != VERDICT_WITHIN:
            undecided = held is None and paired.verdict == INCONCLUSIVE
            return Cliff(family, *(held or (None, None)), spec, compression, paired.describe(), margin,
                         items_needed if undecided else None, layout)
        if held is None or compression > held[1]:
            held = (spec, compression)
    return Cliff(family, *held, margin=margin, layout=layout)


def family_cliffs(report, measure_key: str) -> dict[str, Cliff | None]:
    """Every family's cliff on ``measure_key`` (the chart's stars follow the measure on screen), its points in
    budget order and its compressions read in the report's memory layout."""
    needed = report.plan.fewest_items if report.plan and report.plan.items < report.plan.fewest_items else None
    compression = {p.spec: compression_of(p, report.full, report.layout) for p in report.points}

    def budget_order(point) -> float:
        return -(point.budget if point.budget is not None else np.inf)

    return {f.spec: find_cliff(f.spec, [(p.spec, compression[p.spec], p.paired_by_measure.get(measure_key))
                                        for p in sorted(report.points, key=budget_order)
                                        if p.family == f.spec and p.error is None and compression[p.spec]],
                               report.margin, needed, report.layout)
            for f in report.families if f.member is not None}


def recommendation(points: Sequence, measure: Measure, margin: float, scope: str, needed: int | None,
                   layout: str = "counted") -> list[str]:
    """Sentences a reader can deploy from: full's own score, the most compressed configuration (in ``layout``'s
    bytes) proven within the margin (or that none is: the closest, and how many items proving anything would take),
    and the configurations proven below full; all read from the verdicts the cliffs read."""
    full = full_point(points)
    lines: list[str] = []
    if full is None:
        return lines
    compression = {p.spec: compression_of(p, full, layout) for p in points}
    interval = getattr(full, measure.interval) if measure.interval else None
    if measure.key == "accuracy" and full.accuracy is not None:
        right = sum(bool(o.correct) for o in full.outcomes)
        lines.append(f"{scope}, the full cache is right on {right} of {len(full.outcomes)} "
                     f"({measure.with_interval(full.accuracy, interval)}).")
    judged = [(p, p.paired) for p in points if p is not full and p.paired is not None and compression[p.spec]]
    if not judged:
        return lines
    families = len({p.family for p, _ in judged})
    across = (f"{len(judged)} configuration{'s' if len(judged) != 1 else ''} in {families} "
              f"famil{'ies' if families != 1 else 'y'}")
    proven = [(p, j) for p, j in judged if j.verdict == VERDICT_WITHIN]
    if proven:
        best, paired = max(proven, key=lambda pj: (compression[pj[0].spec], pj[1].difference))
        others = len(proven) - 1
        lines.append(f"Deploy {best.spec}: {smaller_than_full(compression[best.spec], layout)} and proven within "
                     f"{margin:g} points of it on {measure.label}, losing at most "
                     f"{max(0.0, -100 * paired.bound):.1f} points ({paired.interval_text()}; within-margin p "
                     f"{paired.margin_p_adjusted:.3g} after the closed procedure across {across})"
                     + (f"; {others} other{'s are' if others > 1 else ' is'} proven too, less compressed."
                        if others else "."))
    else:
        closest, paired = max(judged, key=lambda pj: (pj[1].difference_ci or (-1.0, -1.0))[0])
        hint = (f" Proving a {margin:g}-point margin takes at least {needed:,} items."
                if needed and paired.verdict == INCONCLUSIVE else "")
        lines.append(f"No configuration is proven within {margin:g} points of full on {measure.label} across "
                     f"{across}; the closest, {closest.spec}, {smaller_than_full(compression[closest.spec], layout)}, "
                     f"{paired.describe()} ({paired.interval_text()}).{hint}")
    below = sorted((p for p, j in judged if j.verdict in BELOW_FULL), key=lambda p: compression[p.spec])
    if below:
        beyond = sum(p.paired.verdict == VERDICT_BEYOND for p in below)
        named = ", ".join(p.spec for p in below[:4]) + (f" and {len(below) - 4} more" if len(below) > 4 else "")
        lines.append(f"{len(below)} {'are' if len(below) > 1 else 'is'} proven below full, {beyond} of them beyond "
                     f"the margin: {named}.")
    return lines


SCOPE_NOTES = {
    "text": "Perplexity on one play measures how well the cache follows text, not whether it answers; it has no "
            "interval and no verdict.",
}


def exploratory_note(report) -> str | None:
    """What a reader must know when the verdicts are read at a margin other than the one fixed before the run."""
    if report.margin == report.margin_fixed:
        return None
    return (f"Exploratory: the margin was fixed at {report.margin_fixed:g} points before this run; read at "
            f"{report.margin:g}, after seeing the data, these verdicts do not hold their 2.5% (a margin chosen from "
            f"the results can always be made to pass). Run again with --margin {report.margin:g} fixed in advance.")


def judged_report(report, margin: float, threshold: float, layout: str = "counted"):
    """A copy of ``report`` with every verdict read at ``margin`` points (exploratory unless it is the margin fixed
    before the run) and the tail at ``threshold``, and memory counted in ``layout``: paired comparisons per measure,
    frontiers, cliffs, the plan and the summary. Measuring is not repeated, so the page re-reads a stored sweep at
    another margin or layout at once."""
    if layout != "counted" and not any(p.layout_bytes for p in report.points):
        raise ValueError(f"this sweep kept no ledger to lay out in {LABELS.get(layout, layout)!r}: counted bytes only")
    if not 0 < margin < 100:
        raise ValueError(f"a margin of {margin:g} points is not a loss between 0 and 100")
    judged = copy.deepcopy(report)
    judged.layout = layout
    points, groups = judged.points, judged.groups
    fill_tail(points, threshold, groups)
    items = len(judged.items) if judged.items else 1
    judged.margin, judged.tail_threshold = margin, threshold
    exploratory = margin != judged.margin_fixed
    for measure in (MEASURES[key] for key in judged.measure_keys):
        for point, paired in zip(points, judge(points, measure, margin, threshold, groups, exploratory), strict=True):
            if paired is not None:
                point.paired_by_measure[measure.key] = paired
    main = MEASURES[judged.measure_keys[0]]
    for point in points:
        point.paired = point.paired_by_measure.get(main.key)
    judged.plan = None
    if judged.workload_kind != "text":
        full = judged.full
        accuracy = full.accuracy if full is not None and full.accuracy else None
        families = len({p.family for p in points if p.paired is not None}) or 1
        judged.plan = plan(judged.item_cap or items, margin, families, judged.item_cap is not None,
                           accuracy if accuracy is not None else 1.0)
    judged.frontiers = {key: [p.spec for p, flag in zip(points, frontier_flags(points, MEASURES[key], threshold,
                                                                                 groups, layout), strict=True) if flag]
                        for key in judged.measure_keys}
    for point in points:
        point.frontier = point.spec in judged.frontiers[main.key]
    judged.cliffs = family_cliffs(judged, main.key)
    single = judged.workload_kind == "prompt" and items == 1
    scope = "On this prompt" if single else f"On {judged.workload}"
    needed = judged.plan.fewest_items if judged.plan and items < judged.plan.fewest_items else None
    note = exploratory_note(judged)
    summary = [note] if note else []
    summary += recommendation(points, main, margin, scope, needed, layout)
    summary += [cliff.sentence() for cliff in judged.cliffs.values() if cliff is not None]
    if single:
        summary.append("One prompt is a single example, not a benchmark: nothing can be proven on it. Sweep a prompt "
                       "set or a task before you deploy.")
    elif judged.workload_kind in SCOPE_NOTES:
        summary.append(SCOPE_NOTES[judged.workload_kind])
    judged.summary = summary
    return judged
