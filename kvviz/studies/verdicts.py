"""A sweep's verdicts: every point judged against full on the same items, each family's cliff, and a recommendation
that is a proof, not a best point estimate.

The rules (docs/quality.md works them through):

- **paired**: each point against full over the same items (:mod:`kvviz.studies.paired`): lost, gained, the
  difference with its 95% interval, the exact McNemar p and the verdict against the margin;
- **cliff** (fixed-sequence testing, no adjustment needed): walking a family from its least compressed point, the
  last point proven within the margin before the first that is not; fewer items can only move it down;
- **recommendation**: the most compressed configuration whose margin test survives Holm's adjustment across every
  point of the sweep;
- **frontier**: a point is dominated only by one with no more bytes that is significantly better on the same items;
- **memory**: compressions, and so the frontier, the cliffs and the recommendation, count the bytes kvviz holds or
  what a serving layout would hold for the same kept tokens (:mod:`kvviz.cache.layouts`); the verdicts against full
  do not depend on memory;
- **tail** (prompt sets): the share of prompts whose agreement with full falls below a threshold, a Wilson interval
  beside it, judged against full (which never falls below) like accuracy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvviz.cache.layouts import LABELS, compression_in
from kvviz.studies.frontier import MEASURES, Measure, on_frontier
from kvviz.studies.intervals import bootstrap_mean, wilson
from kvviz.studies.paired import (
    ALPHA,
    WITHIN,
    WORSE,
    Paired,
    Table,
    holm,
    mcnemar_exact,
    paired_binary,
    paired_mean,
)
from kvviz.studies.power import plan

DEFAULT_TAIL_THRESHOLD = 0.9  # a prompt whose agreement with full falls below 90% counts in the tail
PROVEN = ALPHA / 2  # the margin test is one-sided: the lower half of the two-sided 95% interval


def item_values(point, measure: Measure, threshold: float) -> list | None:
    """The per-item values a paired comparison reads on ``measure``: right/wrong (accuracy), the prompt held at or
    above the threshold (the tail), agreement with full, mean KL; None when the point has none."""
    outcomes = point.outcomes
    if point.error is not None or not outcomes:
        return None
    if measure.key == "accuracy":
        values = [o.correct for o in outcomes]
    elif measure.key == "tail_share":
        values = [None if o.agreement is None else o.agreement >= threshold for o in outcomes]
    elif measure.key in ("agreement_with_full", "mean_kl"):
        values = [o.agreement if measure.key == "agreement_with_full" else o.mean_kl for o in outcomes]
    else:
        return None
    return None if any(v is None for v in values) else values


def fill_tail(points: Sequence, threshold: float, groups: list[str] | None) -> None:
    """Each prompt-set point's share of prompts below ``threshold`` agreement and its 95% interval."""
    for point in points:
        if point.error is not None or not point.outcomes or point.outcomes[0].agreement is None:
            continue
        below = [o.agreement < threshold for o in point.outcomes]
        point.tail_share = sum(below) / len(below)
        point.tail_ci = (wilson(sum(below), len(below)) if groups is None else
                         bootstrap_mean([float(b) for b in below], groups))


def judge(points: Sequence, measure: Measure, margin: float, threshold: float,
          groups: list[str] | None) -> list[Paired | None]:
    """Each point against full (the first point) on ``measure``; full itself and points without items get None.
    Both p-values are Holm-adjusted across the points judged."""
    full = item_values(points[0], measure, threshold)
    judged: list[Paired | None] = [None]
    for point in points[1:]:
        values = item_values(point, measure, threshold)
        if full is None or values is None or measure.paired is None:
            judged.append(None)
        elif measure.paired == "binary":
            judged.append(paired_binary(full, values, margin, groups))
        else:
            judged.append(paired_mean([v - f for f, v in zip(full, values, strict=True)], margin, groups))
    p_adjusted = holm([None if j is None else j.p_value for j in judged])
    margin_adjusted = holm([None if j is None else j.margin_p for j in judged])
    return [None if j is None else replace(j, p_adjusted=p, margin_p_adjusted=m)
            for j, p, m in zip(judged, p_adjusted, margin_adjusted, strict=True)]


def significantly_better(ours: list, theirs: list, measure: Measure, groups: list[str] | None) -> bool:
    """Whether ``ours`` beats ``theirs`` on the same items: the exact McNemar test (right/wrong) or the bootstrap
    interval of the mean difference (a per-item value) excludes no difference, on the better side."""
    if measure.paired == "binary":
        table = Table.of(theirs, ours)
        return table.gained > table.lost and mcnemar_exact(table.lost, table.gained) < ALPHA
    sign = 1.0 if measure.higher_is_better else -1.0
    interval = bootstrap_mean([sign * (o - t) for o, t in zip(ours, theirs, strict=True)], groups)
    return interval is not None and interval[0] > 0


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
    from its least compressed (None: not even that one); ``past`` the first point that is not, and what it could
    hide or that it is worse (None: every point measured is proven). ``items_needed``: how many items proving the
    margin would take at the least, said when nothing is proven."""

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
    """The cliff of a family from its points (SPEC, compression, judgement against full), None when some point was
    not judged. Fixed-sequence: the walk stops at the first point not proven, whatever lies beyond it."""
    if not members or any(paired is None for _, _, paired in members):
        return None
    held: tuple[str, float] | None = None
    for spec, compression, paired in sorted(members, key=lambda m: m[1]):
        if paired.verdict != WITHIN:
            return Cliff(family, *(held or (None, None)), spec, compression, paired.describe(), margin,
                         None if held else items_needed, layout)
        held = (spec, compression)
    return Cliff(family, *held, margin=margin, layout=layout)


def family_cliffs(report, measure_key: str) -> dict[str, Cliff | None]:
    """Every family's cliff on ``measure_key`` (the chart's stars follow the measure on screen), its points ordered
    and its compressions read in the report's memory layout."""
    needed = report.plan.items_for_margin if report.plan else None
    compression = {p.spec: compression_of(p, report.full, report.layout) for p in report.points}
    return {f.spec: find_cliff(f.spec, [(p.spec, compression[p.spec], p.paired_by_measure.get(measure_key))
                                        for p in report.points if p.family == f.spec and p.error is None
                                        and compression[p.spec]], report.margin, needed, report.layout)
            for f in report.families if f.member is not None}


def recommendation(points: Sequence, measure: Measure, margin: float, scope: str, needed: int | None,
                   layout: str = "counted") -> list[str]:
    """Sentences a reader can deploy from: full's own score, the most compressed configuration (in ``layout``'s
    bytes) proven within the margin after Holm's adjustment (or that none is, the closest and how many items proving
    it would take), and the configurations shown worse than full."""
    full = points[0]
    compression = {p.spec: compression_of(p, full, layout) for p in points}
    lines = []
    interval = getattr(full, measure.interval) if measure.interval else None
    if measure.key == "accuracy" and full.accuracy is not None:
        right = sum(bool(o.correct) for o in full.outcomes)
        lines.append(f"{scope}, the full cache is right on {right} of {len(full.outcomes)} "
                     f"({measure.with_interval(full.accuracy, interval)}).")
    judged = [(p, p.paired) for p in points[1:] if p.paired is not None and compression[p.spec]]
    if not judged:
        return lines
    proven = [(p, j) for p, j in judged if j.margin_p_adjusted is not None and j.margin_p_adjusted < PROVEN]
    count = f"{len(judged)} configuration{'s' if len(judged) != 1 else ''}"
    if proven:
        best, paired = max(proven, key=lambda pj: (compression[pj[0].spec], pj[1].difference))
        others = len(proven) - 1
        lines.append(f"Deploy {best.spec}: {smaller_than_full(compression[best.spec], layout)} and proven within "
                     f"{margin:g} points of it on {measure.label} ({paired.interval_text()}; margin test p "
                     f"{paired.margin_p_adjusted:.3f} after Holm's adjustment across {count})"
                     + (f"; {others} other{'s are' if others > 1 else ' is'} proven too, less compressed."
                        if others else "."))
    else:
        closest, paired = max(judged, key=lambda pj: (pj[1].difference_ci or (-1.0, -1.0))[0])
        hint = f" Proving a {margin:g}-point margin takes at least {needed:,} items." if needed else ""
        lines.append(f"No configuration is proven within {margin:g} points of full on {measure.label} after Holm's "
                     f"adjustment across {count}; the closest, {closest.spec}, "
                     f"{smaller_than_full(compression[closest.spec], layout)}, "
                     f"{paired.describe()} ({paired.interval_text()}).{hint}")
    worse = sorted((p for p, j in judged if j.verdict == WORSE), key=lambda p: compression[p.spec])
    if worse:
        named = ", ".join(p.spec for p in worse[:4]) + (f" and {len(worse) - 4} more" if len(worse) > 4 else "")
        lines.append(f"{len(worse)} {'are' if len(worse) > 1 else 'is'} worse than full (the interval of the "
                     f"difference lies below zero and the exact test agrees): {named}.")
    return lines


SCOPE_NOTES = {
    "text": "Perplexity on one play measures how well the cache follows text, not whether it answers; it has no "
            "interval and no verdict.",
}


def judged_report(report, margin: float, threshold: float, layout: str = "counted"):
    """A copy of ``report`` with every verdict read at ``margin`` points and the tail at ``threshold``, and memory
    counted in ``layout``: paired comparisons per measure, frontiers, cliffs, the plan and the summary. Measuring
    is not repeated, so the page re-reads a stored sweep at another margin or layout at once."""
    if layout != "counted" and not any(p.layout_bytes for p in report.points):
        raise ValueError(f"this sweep kept no ledger to lay out in {LABELS.get(layout, layout)!r}: counted bytes only")
    judged = copy.deepcopy(report)
    judged.layout = layout
    points, groups = judged.points, judged.groups
    fill_tail(points, threshold, groups)
    items = len(judged.items) if judged.items else 1
    judged.margin, judged.tail_threshold = margin, threshold
    judged.plan = plan(items, margin) if judged.workload_kind != "text" else None
    for measure in (MEASURES[key] for key in judged.measure_keys):
        for point, paired in zip(points, judge(points, measure, margin, threshold, groups), strict=True):
            if paired is not None:
                point.paired_by_measure[measure.key] = paired
    main = MEASURES[judged.measure_keys[0]]
    for point in points:
        point.paired = point.paired_by_measure.get(main.key)
    judged.frontiers = {key: [p.spec for p, flag in zip(points, frontier_flags(points, MEASURES[key], threshold,
                                                                                 groups, layout), strict=True) if flag]
                        for key in judged.measure_keys}
    for point in points:
        point.frontier = point.spec in judged.frontiers[main.key]
    judged.cliffs = family_cliffs(judged, main.key)
    single = judged.workload_kind == "prompt" and items == 1
    scope = "On this prompt" if single else f"On {judged.workload}"
    needed = judged.plan.items_for_margin if judged.plan else None
    summary = recommendation(points, main, margin, scope, needed, layout)
    summary += [cliff.sentence() for cliff in judged.cliffs.values() if cliff is not None]
    if single:
        summary.append("One prompt is a single example, not a benchmark: nothing can be proven on it. Sweep a prompt "
                       "set or a task before you deploy.")
    elif judged.workload_kind in SCOPE_NOTES:
        summary.append(SCOPE_NOTES[judged.workload_kind])
    judged.summary = summary
    return judged

