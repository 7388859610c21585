"""Curves, not points: every family of methods across its budgets, measured on one workload, with its frontier.

A *family* is a SPEC with one parameter left free: a method named without the parameter its ``sweep_points`` varies
(``snapkv``: the budget; ``kivi``: the bits; ``lowrank``: the rank) or a stack with exactly one such member
(``snapkv+kivi:bits=4`` sweeps SnapKV's budget). A SPEC with nothing free (``fp8``, ``snapkv:budget=256``) is one
point. Each method sizes itself (:meth:`kvviz.cache.spec.Method.sweep_points`), so this module names none.

Every point is measured, never interpolated, on one workload (:mod:`kvviz.studies.workloads`), and carries its
evidence: a 95% interval (:mod:`kvviz.studies.intervals`), the tail beside the mean (the share of prompts below an
agreement threshold, the worst prompt) and one outcome per item, full's included. Each point is judged against full
on the same items at a margin fixed before the run (:mod:`kvviz.studies.verdicts`): within the margin, beyond it,
worse (within unproven), or inconclusive; each family's *cliff* is its most compressed point proven within the
margin, and the recommendation reads the same decisions. A fixed design measures every item once; an adaptive one
runs in rounds and stops each point once it is decided (:mod:`kvviz.studies.sweep_rounds`). Measuring is
:mod:`kvviz.studies.sweep_measure`: all configurations of a wave of items decode in one batch, and a play's
configurations stream together; the rows may come from shards run elsewhere (a Ray cluster:
:mod:`kvviz.studies.sweep_ray`), and fill the same points.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field, replace

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE, LABELS
from kvviz.methods import MethodStack, Sizing, SpecError, parse_spec
from kvviz.planning.memory import model_card
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.frontier import MEASURES
from kvviz.studies.intervals import BOOTSTRAP_RULE, WILSON_RULE
from kvviz.studies.paired import DEFAULT_MARGIN, Paired
from kvviz.studies.power import Plan
from kvviz.studies.sweep_measure import Measured, Outcome, fill_points
from kvviz.studies.sweep_rounds import Adaptive, RoundSource, RoundsRun, in_process, measure_in_rounds
from kvviz.studies.sweep_shards import ShardRun, ShardStore
from kvviz.studies.verdicts import (
    DEFAULT_TAIL_THRESHOLD,
    Cliff,
    compression_of,
    full_point,
    held_bytes,
    judged_report,
)
from kvviz.studies.workloads import ANSWER_RULE, TaskWorkload, Workload, check_workload

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
    a measure that does not apply to the workload is None. Intervals are 95% ``[low, high]``. ``paired``: judged
    against full on the same items on the main measure (None for full, and where nothing pairs);
    ``paired_by_measure``: the same on every measure that pairs."""

    spec: str
    family: str
    kind: str
    budget: float | None
    kv_bytes: int | None = None
    kv_bytes_full: int | None = None
    agreement_with_full: float | None = None
    agreement_ci: tuple[float, float] | None = None
    worst_prompt_agreement: float | None = None
    tail_share: float | None = None  # prompts whose agreement with full falls below the report's threshold
    tail_ci: tuple[float, float] | None = None
    mean_kl: float | None = None
    kl_p95: float | None = None
    first_divergence: int | None = None  # the earliest over the prompts
    accuracy: float | None = None
    accuracy_ci: tuple[float, float] | None = None
    perplexity: float | None = None
    items_scored: int | None = None
    paired: Paired | None = None
    paired_by_measure: dict[str, Paired] = field(default_factory=dict)
    factors: dict | None = None  # the formula's split: architecture, eviction, quantization
    full_precision_bytes: int | None = None  # of kv_bytes, those held unquantized (a quantizer's residual)
    frontier: bool = False  # on the frontier of the workload's main measure
    layout_bytes: dict | None = None  # mean over items of what each serving layout would hold (kvviz.cache.layouts)
    outcomes: list[Outcome] = field(default_factory=list)
    error: str | None = None
    items_used: int | None = None  # the items it ran (an adaptive sweep stops a point once it is decided)
    stopped: str | None = None  # why it stopped taking items: within, beyond, worse, cap (None: a fixed design)
    stopped_at_look: int | None = None  # the look (after which round, from 1) it stopped at

    @property
    def compression(self) -> float | None:
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes and self.kv_bytes_full else None

    def to_json(self) -> dict:
        data = asdict(self)
        for key in ("agreement_ci", "accuracy_ci", "tail_ci"):
            data[key] = None if data[key] is None else [round(v, 4) for v in data[key]]
        data["paired"] = None if self.paired is None else self.paired.to_json()
        data["paired_by_measure"] = {key: paired.to_json() for key, paired in self.paired_by_measure.items()}
        data["compression"] = None if self.compression is None else round(self.compression, 4)
        return data


@dataclass
class SweepReport:
    """Every point of one sweep, the frontier of each measure, each family's cliff, and the recommendation, all
    read at ``margin`` points (:func:`kvviz.studies.verdicts.judged_report` re-reads them at another)."""

    model: str
    workload: str
    workload_kind: str
    prompt_tokens: int
    budgets: list[float]
    families: list[Family]
    points: list[SweepPoint]
    measure_keys: list[str]  # the workload's measures, the main one first
    seconds: float
    notes: list[str] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)  # what was scored: id, prompt text, expected answer
    cliffs: dict[str, Cliff | None] = field(default_factory=dict)  # family SPEC -> its cliff
    rules: dict[str, str] = field(default_factory=dict)  # how intervals and answers are read
    shard_run: ShardRun | None = None  # how a sharded sweep ran (workers, shards, reused); None in process
    groups: list[str] | None = None  # each item's group when prompts share documents
    frontiers: dict[str, list[str]] = field(default_factory=dict)  # measure -> the SPECs on its frontier
    summary: list[str] = field(default_factory=list)
    margin: float = DEFAULT_MARGIN  # points of the main measure a deployment may lose
    tail_threshold: float = DEFAULT_TAIL_THRESHOLD
    plan: Plan | None = None  # what this many items can detect and prove (None: a play has no items)
    block_size: int = DEFAULT_BLOCK_SIZE  # token slots per block of the paged layouts in each point's layout_bytes
    layout: str = "counted"  # the memory that compressions, frontiers, cliffs and the summary count (cache.layouts)
    margin_fixed: float = DEFAULT_MARGIN  # the margin fixed before the run: verdicts read at another are exploratory
    item_cap: int | None = None  # an adaptive sweep's cap on items (None: a fixed design, one look at every item)
    rounds: RoundsRun | None = None  # how the rounds went (None for a play)

    @property
    def main_measure(self) -> str:
        return self.measure_keys[0]

    @property
    def full(self) -> SweepPoint | None:
        """The full cache's point, every other point's reference (None where it failed to run)."""
        return full_point(self.points)

    def to_json(self) -> dict:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens, "workload": self.workload,
                "workload_kind": self.workload_kind, "budgets": self.budgets, "main_measure": self.main_measure,
                "rules": self.rules, "items": self.items,
                "families": [asdict(f) | {"describe": f.describe(), "cliff": _cliff_json(self.cliffs.get(f.spec))}
                             for f in self.families],
                "points": [p.to_json() for p in self.points], "frontiers": self.frontiers, "summary": self.summary,
                "margin": self.margin, "tail_threshold": self.tail_threshold,
                "plan": None if self.plan is None else self.plan.to_json(),
                "notes": self.notes, "seconds": round(self.seconds, 3), "block_size": self.block_size,
                "layout": self.layout, "margin_fixed": self.margin_fixed, "item_cap": self.item_cap,
                "exploratory": self.margin != self.margin_fixed,
                "rounds": None if self.rounds is None else self.rounds.to_json(),
                **(self.shard_run.to_json() if self.shard_run is not None else {})}

    def to_frame(self):
        import pandas as pd

        hidden = ("factors", "outcomes", "paired", "paired_by_measure", "layout_bytes", "stopped_at_look")
        rows = [{k: v for k, v in p.to_json().items() if k not in hidden} | self._layout_columns(p)
                | _paired_columns(p.paired) for p in self.points]
        return pd.DataFrame(rows)

    def _layout_columns(self, point: SweepPoint) -> dict:
        """What the report's layout holds for the point and its compression there (nothing for counted bytes)."""
        if self.layout == "counted":
            return {}
        held, compression = held_bytes(point, self.layout), compression_of(point, self.full, self.layout)
        return {f"{self.layout}_bytes": None if held is None else round(held),
                f"{self.layout}_compression": None if compression is None else round(compression, 4)}

    def markdown(self) -> str:
        """One table row per point, each measure with its interval where it has one, and the main measure's paired
        comparison with full: lost/gained, the difference with its interval, the verdict."""
        measures = [m for m in MEASURES.values() if any(getattr(p, m.key) is not None for p in self.points)]
        in_layout = [] if self.layout == "counted" else [f"{LABELS[self.layout]}: {what}" for what in
                                                         ("bytes", "compression")]
        header = ["spec", "family", "budget", "KV bytes", "compression", *in_layout, *(m.label for m in measures),
                  "lost / gained", "vs full [95%]", f"verdict at {self.margin:g} points", "frontier"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            values = [getattr(p, m.key) for m in measures]
            cells = [p.spec, p.family, "" if p.budget is None else f"{p.budget:.3g}",
                     "" if p.kv_bytes is None else f"{p.kv_bytes:,}",
                     "" if p.compression is None else f"{p.compression:.2f}x",
                     *("" if v is None else f"{v:,}" if k.endswith("_bytes") else f"{v:.2f}x"
                       for k, v in self._layout_columns(p).items()),
                     *("" if v is None else m.with_interval(v, getattr(p, m.interval) if m.interval else None)
                       for m, v in zip(measures, values, strict=True)),
                     "" if p.paired is None else f"{p.paired.lost} / {p.paired.gained}",
                     "" if p.paired is None else p.paired.interval_text(),
                     "" if p.paired is None else f"`{p.paired.verdict}`", "yes" if p.frontier else ""]
            if p.error:
                cells[-1] = f"error: {p.error}"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _paired_columns(paired: Paired | None) -> dict:
    """The main measure's comparison with full as table columns (empty for full)."""
    if paired is None:
        return {"verdict": None, "lost": None, "gained": None, "versus_full": None, "p_adjusted": None}
    return {"verdict": paired.verdict, "lost": paired.lost, "gained": paired.gained,
            "versus_full": paired.interval_text(), "p_adjusted": paired.p_adjusted}


def _cliff_json(cliff: Cliff | None) -> dict | None:
    return None if cliff is None else asdict(cliff) | {"sentence": cliff.sentence()}


def run_sweep(loaded: LoadedModel, workload: Workload, specs: list[str], budgets: list[float] = DEFAULT_BUDGETS,
              progress: Progress | None = None, source: RoundSource | None = None, margin: float = DEFAULT_MARGIN,
              tail_threshold: float = DEFAULT_TAIL_THRESHOLD, block_size: int = DEFAULT_BLOCK_SIZE,
              adaptive: Adaptive | None = None, store: ShardStore | None = None) -> SweepReport:
    """Measure every family at every budget on ``workload`` (full first, the reference) and judge every point
    against full at ``margin`` points, fixed now: frontiers, cliffs, the recommendation. A fixed design measures
    every item once; ``adaptive`` runs in rounds and stops each point once it is decided. ``source`` measures
    elsewhere (shards on a cluster); by default this process measures, keeping an adaptive sweep's rounds in
    ``store`` (a larger cap later continues them). ValueError
    (SpecError, PromptError included) for bad arguments, before any model work. Layouts page in blocks of
    ``block_size`` token slots (``source`` measures with the same)."""
    check_sweep(list(specs), list(budgets), workload)
    if not 0 < margin < 100:
        raise ValueError(f"a margin of {margin:g} points is not a loss between 0 and 100")
    if adaptive is not None:
        adaptive.check()
        if workload.kind == "text":
            raise ValueError("a play is one stream of text, with no items to add in rounds: sweep it without "
                             "--adaptive")
    card = model_card(loaded)
    sizing = Sizing(workload.sizing_length(), card.kv_heads, card.head_dim, card.bytes_per_element)
    families, planned = plan(list(specs), list(budgets), sizing)
    started = time.perf_counter()
    full = Family("full", None, (), "fixed")
    planned = [(full, None, "full"), *planned]
    points = [SweepPoint(spec, family.spec, family.kind, share) for family, share, spec in planned]
    main = workload.measures[0]
    here = in_process(loaded, workload, block_size, store if adaptive is not None else None)  # rounds to continue
    rows, rounds = measure_in_rounds(workload, points, source or here, main.key, tail_threshold, margin, adaptive,
                                     progress)
    measured: Measured = fill_points(workload, points, rows)
    for point, allocated in zip(points, rounds.allocation, strict=True):
        point.items_used, point.stopped, point.stopped_at_look = (allocated.items_used, allocated.stopped,
                                                                  allocated.look)
    notes = measured.notes + budget_reversals(points)
    measure_keys = [m.key for m in workload.measures]
    rules = {}
    if main.interval == "accuracy_ci":
        rules["interval"] = WILSON_RULE
    elif main.interval == "agreement_ci" and len(measured.items) > 1:
        rules["interval"] = BOOTSTRAP_RULE
    if main.paired is not None:
        rules["paired"] = PAIRED_RULE
        rules["verdicts"] = VERDICT_RULE
    if workload.kind == "prompt" and workload.answered:
        rules["answer"] = ANSWER_RULE
        rules["agreement_interval"] = BOOTSTRAP_RULE
    if measured.groups is not None:
        rules["groups"] = GROUPS_RULE
    if progress is not None and rounds.shard_run is None:  # a sharded sweep's bar ends with its last shard
        progress(1.0, "done")
    used = replace(workload, items=rounds.items) if isinstance(workload, TaskWorkload) else workload
    report = SweepReport(loaded.name, used.describe(), workload.kind, measured.prompt_tokens, list(budgets),
                         families, points, measure_keys, time.perf_counter() - started, notes, measured.items,
                         rules=rules, shard_run=rounds.shard_run, groups=measured.groups, block_size=block_size,
                         margin=margin, margin_fixed=margin,
                         item_cap=None if adaptive is None else adaptive.max_items,
                         rounds=None if workload.kind == "text" else rounds)
    return judged_report(report, margin, tail_threshold)


PAIRED_RULE = ("each configuration against full on the same units (items, or groups of items sharing a document): "
               "lost and gained items, the mean difference with its anytime-valid 95% interval (a betting confidence "
               "sequence, Waudby-Smith & Ramdas 2023)")
VERDICT_RULE = ("three one-sided claims per point, each an anytime-valid test at 2.5% across the whole sweep: within "
                "the margin (a closed procedure: each family an equal share, its points tested from the least "
                "compressed budget), beyond it and below full (Holm across every point); a point may stop at any "
                "look, and the cliffs and the recommendation read the same decisions")
GROUPS_RULE = ("prompts sharing a group (one document) are one unit of every test, and resampled together in every "
               "interval")


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
