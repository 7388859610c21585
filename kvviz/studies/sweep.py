"""Curves, not points: every family of methods across its budgets, measured on one workload, with its frontier.

A *family* is a SPEC with one parameter left free: a method named without the parameter its ``sweep_points`` varies
(``snapkv``: the budget; ``kivi``: the bits; ``lowrank``: the rank) or a stack with exactly one such member
(``snapkv+kivi:bits=4`` sweeps SnapKV's budget). A SPEC with nothing free (``fp8``, ``snapkv:budget=256``) is one
point. Each method sizes itself (:meth:`kvviz.cache.spec.Method.sweep_points`), so this module names none.

Every point is measured, never interpolated, on one workload (:mod:`kvviz.studies.workloads`), and carries its
evidence: a 95% interval (:mod:`kvviz.studies.intervals`), the tail beside the mean (the worst prompt, the
95th-percentile per-token KL) and one outcome per item. A point whose interval overlaps full's is indistinguishable
from full at this sample size; each family's *cliff* is where it stops being so (:func:`kvviz.studies.frontier.
find_cliff`). Measuring is :mod:`kvviz.studies.sweep_measure`: all configurations of a wave of items decode in one
batch, and a play's configurations stream together; the rows it measures may come from shards run elsewhere (a Ray
cluster: :mod:`kvviz.studies.sweep_ray`), and fill the same points.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.methods import MethodStack, Sizing, SpecError, parse_spec
from kvviz.planning.memory import model_card
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.frontier import MEASURES, Candidate, Cliff, find_cliff, on_frontier, recommendation
from kvviz.studies.intervals import BOOTSTRAP_RULE, WILSON_RULE, overlap
from kvviz.studies.sweep_measure import Measured, Outcome, Rows, fill_points, measure_rows
from kvviz.studies.sweep_shards import ShardRun
from kvviz.studies.workloads import ANSWER_RULE, Workload, check_workload

DEFAULT_BUDGETS = (0.0625, 0.125, 0.25, 0.5)
# The Trade-offs page's default run: one family per axis idea, whose curves cross on the lesson prompt (a test pins it)
DEFAULT_FAMILIES = ("snapkv", "streaming_llm", "h2o", "kivi:residual=0", "snapkv+kivi:bits=4,residual=0")
@dataclass(frozen=True)
class Family:
    """One SPEC of a sweep: which member's parameter is free (``member`` None: a fixed configuration, one point)."""

    spec: str
    member: str | None
    swept: tuple[str, ...]
    kind: str  # the free member's axis, "stack" when it shares the stack with other methods, or "fixed"

    def describe(self) -> str:
        if self.member is None:
            return f"{self.spec}: one point"
        return f"{self.spec}: sweeps {self.member}'s {', '.join(self.swept)}"


def read_family(spec: str) -> Family:
    """The family a SPEC names; SpecError when it leaves more than one member free (a curve has one parameter)."""
    stack = parse_spec(spec)
    free = [m for m in stack.members() if type(m).swept_params() and not m.given & set(type(m).swept_params())]
    if len(free) > 1:
        names = " and ".join(f"{m.name}'s {', '.join(type(m).swept_params())}" for m in free)
        example = f"{free[-1].name}:{type(free[-1]).swept_params()[0]}=..."
        raise SpecError(f"'{spec}' leaves {names} free; a family sweeps one parameter: fix the other ({example})")
    if not free:
        return Family(stack.label, None, (), "fixed")
    member = free[0]
    kind = "stack" if len(stack.members()) > 1 else member.kind
    return Family(stack.label, member.name, type(member).swept_params(), kind)


def family_specs(family: Family, budgets: list[float], sizing: Sizing) -> list[tuple[float | None, str]]:
    """(the share of full each point was sized to, its SPEC), one per distinct configuration, in budget order.

    A budget the method cannot hold with the family's fixed values gives no point."""
    stack = parse_spec(family.spec)
    if family.member is None:
        return [(None, stack.label)]
    member = next(m for m in stack.members() if m.name == family.member)
    fixed = {name: getattr(member, name) for name in member.given}
    points: dict[str, float] = {}
    for share, sized in type(member).sweep_points(budgets, sizing, fixed):
        swapped = MethodStack(**{m.kind: (sized if m is member else m) for m in stack.members()})
        try:
            label = parse_spec(swapped.label).label  # the stack's own checks (re-rotation, v_rank) run again
        except SpecError:
            continue
        points.setdefault(label, share)
    return [(share, label) for label, share in points.items()]


def check_budgets(budgets: list[float]) -> None:
    """ValueError unless every budget is a share of the full cache in (0, 1]."""
    if not budgets:
        raise ValueError("give at least one budget, a share of the full cache in (0, 1]")
    for budget in budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"budget {budget:g} is outside (0, 1]: a budget is a share of the full cache")


def check_sweep(specs: list[str], budgets: list[float], workload: Workload | None = None,
                max_items: int | None = None) -> list[Family]:
    """The families of ``specs``, or ValueError (SpecError included) with one line: a bad SPEC or budget, a bad
    workload (more items than ``max_items``, the server's limit, included), or nothing left free to sweep. Needs no
    model, so the CLI and the page check before any work."""
    check_budgets(budgets)
    if workload is not None:
        check_workload(workload, max_items)
    if not specs:
        raise ValueError("give at least one method SPEC")
    families = [read_family(spec) for spec in specs]
    if all(f.member is None for f in families):
        raise ValueError(f"nothing to sweep: {', '.join(f.spec for f in families)} "
                         f"{'has' if len(families) == 1 else 'have'} no free parameter; name a method without "
                         "its budget (snapkv, kivi, lowrank) or run fixed SPECs through compare")
    return families


def plan(specs: list[str], budgets: list[float], sizing: Sizing) -> tuple[list[Family], list[tuple[Family,
                                                                                              float | None, str]]]:
    """The families and every point (family, share, SPEC), each SPEC once (the first family to reach it keeps it).
    ValueError as :func:`check_sweep` says."""
    families = check_sweep(specs, budgets)
    seen: set[str] = {"full"}
    points = []
    for family in families:
        for share, spec in family_specs(family, budgets, sizing):
            if spec not in seen:
                seen.add(spec)
                points.append((family, share, spec))
    return families, points


@dataclass
class SweepPoint:
    """One measured configuration. ``budget``: the share of full it was sized to (None: a fixed configuration);
    a measure that does not apply to the workload is None. Intervals are 95% ``[low, high]``; ``like_full``: the
    main measure's interval overlaps full's (None: no interval to tell)."""

    spec: str
    family: str
    kind: str
    budget: float | None
    kv_bytes: int | None = None
    kv_bytes_full: int | None = None
    agreement_with_full: float | None = None
    agreement_ci: tuple[float, float] | None = None
    worst_prompt_agreement: float | None = None
    mean_kl: float | None = None
    kl_p95: float | None = None
    first_divergence: int | None = None  # the earliest over the prompts
    accuracy: float | None = None
    accuracy_ci: tuple[float, float] | None = None
    perplexity: float | None = None
    items_scored: int | None = None
    like_full: bool | None = None
    factors: dict | None = None  # the formula's split: architecture, eviction, quantization
    full_precision_bytes: int | None = None  # of kv_bytes, those held unquantized (a quantizer's residual)
    frontier: bool = False  # on the frontier of the workload's main measure
    layout_bytes: dict | None = None  # mean over items of what each serving layout would hold (kvviz.cache.layouts)
    outcomes: list[Outcome] = field(default_factory=list)
    error: str | None = None

    @property
    def compression(self) -> float | None:
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes and self.kv_bytes_full else None

    def to_json(self) -> dict:
        data = asdict(self)
        for key in ("agreement_ci", "accuracy_ci"):
            data[key] = None if data[key] is None else [round(v, 4) for v in data[key]]
        data["compression"] = None if self.compression is None else round(self.compression, 4)
        return data


@dataclass
class SweepReport:
    """Every point of one sweep, the frontier of each measure, each family's cliff, and the recommendation."""

    model: str
    workload: str
    workload_kind: str
    prompt_tokens: int
    budgets: list[float]
    families: list[Family]
    points: list[SweepPoint]
    frontiers: dict[str, list[str]]  # measure -> the SPECs on its frontier
    summary: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)  # what was scored: id, prompt text, expected answer
    cliffs: dict[str, Cliff | None] = field(default_factory=dict)  # family SPEC -> its cliff
    rules: dict[str, str] = field(default_factory=dict)  # how intervals and answers are read
    shard_run: ShardRun | None = None  # how a sharded sweep ran (workers, shards, reused); None in process
    block_size: int = DEFAULT_BLOCK_SIZE  # token slots per block of the paged layouts in each point's layout_bytes

    @property
    def main_measure(self) -> str:
        return next(iter(self.frontiers))

    def to_json(self) -> dict:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens, "workload": self.workload,
                "workload_kind": self.workload_kind, "budgets": self.budgets, "main_measure": self.main_measure,
                "rules": self.rules, "items": self.items,
                "families": [asdict(f) | {"describe": f.describe(), "cliff": _cliff_json(self.cliffs.get(f.spec))}
                             for f in self.families],
                "points": [p.to_json() for p in self.points], "frontiers": self.frontiers, "summary": self.summary,
                "notes": self.notes, "seconds": round(self.seconds, 3), "block_size": self.block_size,
                **(self.shard_run.to_json() if self.shard_run is not None else {})}

    def to_frame(self):
        import pandas as pd

        dropped = ("factors", "outcomes", "layout_bytes")
        rows = [{k: v for k, v in p.to_json().items() if k not in dropped} for p in self.points]
        return pd.DataFrame(rows)

    def markdown(self) -> str:
        """One table row per point, each measure with its interval where it has one."""
        measures = [m for m in MEASURES.values() if any(getattr(p, m.key) is not None for p in self.points)]
        header = ["spec", "family", "budget", "KV bytes", "compression", *(m.label for m in measures), "frontier"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            values = [getattr(p, m.key) for m in measures]
            cells = [p.spec, p.family, "" if p.budget is None else f"{p.budget:.3g}",
                     "" if p.kv_bytes is None else f"{p.kv_bytes:,}",
                     "" if p.compression is None else f"{p.compression:.2f}x",
                     *("" if v is None else m.with_interval(v, getattr(p, m.interval) if m.interval else None)
                       for m, v in zip(measures, values, strict=True)),
                     "yes" if p.frontier else ""]
            if p.error:
                cells[-1] = f"error: {p.error}"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cliff_json(cliff: Cliff | None) -> dict | None:
    return None if cliff is None else asdict(cliff) | {"sentence": cliff.sentence()}


# Measures the rows of every item under the SPECs given (full first): in process, or shards on a cluster
RowSource = Callable[[list[str], Progress | None], tuple[Rows, ShardRun | None]]
SCOPE_NOTES = {
    "text": "Perplexity on one play measures how well the cache follows text, not whether it answers; it has no "
            "interval.",
}


def in_process(loaded: LoadedModel, workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE) -> RowSource:
    """Every item measured here, in one go."""
    def measure(specs: list[str], progress: Progress | None) -> tuple[Rows, ShardRun | None]:
        return measure_rows(loaded, workload, specs, None, progress, block_size), None

    return measure


def run_sweep(loaded: LoadedModel, workload: Workload, specs: list[str], budgets: list[float] = DEFAULT_BUDGETS,
              progress: Progress | None = None, rows: RowSource | None = None,
              block_size: int = DEFAULT_BLOCK_SIZE) -> SweepReport:
    """Measure every family at every budget on ``workload`` (full first, the reference), then mark the frontiers,
    which points are indistinguishable from full, and each family's cliff. ``rows`` measures elsewhere (shards on
    a cluster); by default this process measures every item. ValueError (SpecError, PromptError included) for bad
    arguments, before any model work. Layouts page in blocks of ``block_size`` token slots (``rows`` measures
    with the same)."""
    check_sweep(list(specs), list(budgets), workload)
    card = model_card(loaded)
    sizing = Sizing(workload.sizing_length(), card.kv_heads, card.head_dim, card.bytes_per_element)
    families, planned = plan(list(specs), list(budgets), sizing)
    started = time.perf_counter()
    full = Family("full", None, (), "fixed")
    planned = [(full, None, "full"), *planned]
    points = [SweepPoint(spec, family.spec, family.kind, share) for family, share, spec in planned]
    measured_rows, shard_run = (rows or in_process(loaded, workload, block_size))([p.spec for p in points], progress)
    measured: Measured = fill_points(workload, points, measured_rows)
    notes = measured.notes + budget_reversals(points)
    frontiers = {}
    for quality in workload.measures:
        flags = on_frontier([(p.kv_bytes, getattr(p, quality.key)) for p in points], quality)
        frontiers[quality.key] = [p.spec for p, flag in zip(points, flags, strict=True) if flag]
    main = workload.measures[0]
    mark_like_full(points, main.interval)
    for point in points:
        point.frontier = point.spec in frontiers[main.key]
    cliffs = {f.spec: find_cliff(f.spec, [(p.spec, p.compression, p.like_full) for p in points
                                          if p.family == f.spec and p.error is None and p.compression])
              for f in families}
    scope = "On this prompt" if workload.kind == "prompt" and len(measured.items) == 1 else \
        f"On {workload.describe()}"
    summary = recommendation([Candidate(p.spec, p.kind, p.compression, getattr(p, main.key),
                                        getattr(p, main.interval) if main.interval else None, p.like_full)
                              for p in points if p.error is None], main, scope)
    summary += [cliff.sentence() for cliff in cliffs.values() if cliff is not None]
    if workload.kind == "prompt" and len(measured.items) == 1:
        summary.append("One prompt is a single example, not a benchmark: it has no interval. Sweep a prompt set or "
                       "a task before you deploy.")
    elif workload.kind in SCOPE_NOTES:
        summary.append(SCOPE_NOTES[workload.kind])
    rules = {}
    if main.interval == "accuracy_ci":
        rules["interval"] = WILSON_RULE
    elif main.interval == "agreement_ci" and len(measured.items) > 1:
        rules["interval"] = BOOTSTRAP_RULE
    if workload.kind == "prompt" and workload.answered:
        rules["answer"] = ANSWER_RULE
        rules["agreement_interval"] = BOOTSTRAP_RULE
    if progress is not None and shard_run is None:  # a sharded sweep's bar ends with its last shard
        progress(1.0, "done")
    return SweepReport(loaded.name, workload.describe(), workload.kind, measured.prompt_tokens, list(budgets),
                       families, points, frontiers, summary, time.perf_counter() - started, notes, measured.items,
                       cliffs, rules, shard_run, block_size)


def mark_like_full(points: list[SweepPoint], interval_key: str | None) -> None:
    """Each measured point's ``like_full``: whether its interval of the main measure overlaps full's (None when
    the measure has no interval, or full's is missing)."""
    reference = getattr(points[0], interval_key) if interval_key else None
    for point in points:
        own = getattr(point, interval_key) if interval_key else None
        if point.error is None and reference is not None and own is not None:
            point.like_full = overlap(own, reference)


def budget_reversals(points: list[SweepPoint]) -> list[str]:
    """A note for each family where a smaller budget holds more bytes than a larger one (a quantizer stacked on an
    eviction: the few tokens kept do not fill a quantization group, so they stay at full precision)."""
    notes = []
    by_family: dict[str, list[SweepPoint]] = {}
    for point in points:
        if point.budget is not None and point.kv_bytes:
            by_family.setdefault(point.family, []).append(point)
    for family, members in by_family.items():
        members.sort(key=lambda p: p.budget)
        for smaller, larger in itertools.pairwise(members):
            if smaller.kv_bytes > larger.kv_bytes:
                why = ""
                if smaller.full_precision_bytes:
                    why = (f": {smaller.full_precision_bytes / smaller.kv_bytes:.0%} of its bytes are tokens held at "
                           "full precision because too few were kept to fill a quantization group")
                notes.append(f"{family} holds more at budget {smaller.budget:g} ({smaller.kv_bytes:,} B) than at "
                             f"{larger.budget:g} ({larger.kv_bytes:,} B){why}. Its line turns back on the chart.")
                break
    return notes
