"""Measuring a sweep's points on each kind of workload: every configuration of every item or prompt in one running
batch, every configuration of a play in one streaming forward per token.

Measuring is two steps so that a sweep can be cut into shards (:mod:`kvviz.studies.sweep_shards`): decoding some of
a workload's items under every configuration gives :class:`Rows`, one :class:`ItemRecord` per item (what the item
is, and one small :class:`Cell` per configuration: no ledgers or tensors, so a shard is cheap to store and to send
between machines); filling reads the records of every item, in item order, into the points (``full`` first, the
reference) and returns what the report needs besides: the prompt length, notes, and the items it scored. Records
joined from shards fill the same points as records measured in one go. Each kind of workload is one small class
(:class:`TaskMeasuring`, :class:`PromptMeasuring`, :class:`TextMeasuring`) with both steps.

Every item is scored under every configuration, full included: a configuration is judged against full on the same
items (:mod:`kvviz.studies.paired`), so full's misses count (they are where a configuration can gain).

Scoring a round (each run's ledger read for its planted spans and serving layouts) is torch work large enough to run
in parallel, and the thread that asks for the rounds (the CLI's main thread, a page's script thread) lives on through
all of them: its OpenMP pool would stay beside the engine's and slow every later round's prefill
(:mod:`kvviz.runtime.threads`). So a round is scored on a thread that exits when the round's rows are ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import numpy as np

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.comparison.batched import decode_prompts
from kvviz.comparison.results import MethodResult
from kvviz.comparison.session import BOTH, FORCED, FREE
from kvviz.methods import SpecError, parse_spec
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.runtime.threads import on_passing_thread
from kvviz.studies.intervals import bootstrap_mean, percentile, wilson
from kvviz.studies.perplexity import play_text, streaming_perplexities
from kvviz.studies.tail_attribution import failure_cause, span_fates
from kvviz.studies.tail_items import NEW_TOKENS, TailItem, stream_items
from kvviz.studies.workloads import PromptCase, PromptWorkload, TaskWorkload, TextWorkload, Workload, answer_found


@dataclass
class Outcome:
    """One item (or prompt) under one configuration. ``correct``: for tasks and answered prompts; ``agreement`` and
    ``mean_kl``: teacher-forced on full's tokens, for prompts. ``versus_full``: ``both_right``, ``lost`` (full right,
    this wrong), ``gained`` (the reverse) or ``both_wrong``. ``evicted``: each planted span the cache evicted from some
    layer, with how many layers evicted it; ``cause`` of a failure as the Tail risk page gives it."""

    item: str
    correct: bool | None = None
    agreement: float | None = None
    mean_kl: float | None = None
    cause: str = ""
    evicted: dict[str, int] = field(default_factory=dict)
    answer: str = ""
    versus_full: str = ""


def versus(full: bool, ours: bool) -> str:
    """An item's pair of outcomes in words (:class:`Outcome`)."""
    return {(True, True): "both_right", (True, False): "lost", (False, True): "gained",
            (False, False): "both_wrong"}[(full, ours)]


@dataclass
class Measured:
    """What measuring a workload leaves besides the points: the prompt length, notes, and the items scored (id,
    prompt text, expected answer), listed once for the whole sweep, with each item's group when some share one."""

    prompt_tokens: int
    notes: list[str]
    items: list[dict] = field(default_factory=list)
    groups: list[str] | None = None


@dataclass
class Cell:
    """One item under one configuration, reduced to what its point reads: bytes, the outcome, per-step KL and first
    divergence (prompts), perplexity (a play), or the error."""

    error: str | None = None
    kv_bytes: int = 0
    kv_bytes_full: int = 0
    full_precision_bytes: int = 0
    factors: dict | None = None
    outcome: Outcome | None = None
    kl_per_step: list[float] = field(default_factory=list)
    first_divergence: int | None = None
    perplexity: float | None = None
    layout_bytes: dict | None = None  # what each serving layout would hold (kvviz.cache.layouts); None for a play


@dataclass
class ItemRecord:
    """One item of a workload measured under some configurations: what it is (id, prompt, expected answer), its
    prompt tokens, the document it shares with others (``group``; None: its own) and one :class:`Cell` per
    configuration, full first (None where a configuration did not run the item: an adaptive sweep stopped it)."""

    listing: dict
    tokens: int
    cells: list[Cell | None]
    group: str | None = None


@dataclass
class Rows:
    """Items of a workload measured under configurations, one record per item, in the order the items were used."""

    records: list[ItemRecord] = field(default_factory=list)
    reused: bool = False  # read back from a store, not measured now

    @classmethod
    def join(cls, parts: Sequence[Rows]) -> Rows:
        """The records of several shards as one, in the order given (the items' order)."""
        return cls([record for part in parts for record in part.records])

    def column(self, index: int) -> list[Cell]:
        """The cells of the configuration at ``index`` on the items it ran (a prefix of full's: the first items)."""
        return [record.cells[index] for record in self.records if record.cells[index] is not None]

    def groups(self) -> list[str] | None:
        """Each item's group (its own id when it has none), or None when no item shares a group."""
        if all(record.group is None for record in self.records):
            return None
        return [record.group or record.listing["id"] for record in self.records]

    def mean_tokens(self) -> int:
        return round(sum(record.tokens for record in self.records) / len(self.records))


def item_count(workload: Workload) -> int:
    """How many items a workload has: a task's items, a set's prompts, and a play is one stream (one item)."""
    if isinstance(workload, TaskWorkload):
        return workload.items
    if isinstance(workload, PromptWorkload):
        return len(workload.prompts)
    return 1


UNIT_ORDER_SEED = 0  # prompt sets are used in one fixed shuffled order: independent units, whatever the file's order


def unit_order(workload: Workload) -> list[tuple[int, ...]]:
    """The units of ``workload`` (each the item indices of one group, or one item) in the order a sweep uses them:
    a task's items in stream order (up to its item count), a prompt set's groups shuffled from a fixed seed (a
    file sorted by topic or length would otherwise feed the tests units that are not alike in law), a play whole."""
    if not isinstance(workload, PromptWorkload):
        return [(index,) for index in range(item_count(workload))]
    members: dict[str, list[int]] = {}
    for index, prompt in enumerate(workload.prompts):
        members.setdefault(prompt.group or f"\0{index}", []).append(index)
    units = [tuple(indices) for indices in members.values()]
    order = np.random.default_rng(UNIT_ORDER_SEED).permutation(len(units))
    return [units[i] for i in order]


def measure_rows(loaded: LoadedModel, workload: Workload, specs: list[str], indices: Sequence[int] | None = None,
                 progress: Progress | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """Every SPEC (``full`` first) on the items at ``indices`` (all when None), as :class:`Rows`; layouts page in
    blocks of ``block_size`` token slots."""
    chosen = range(item_count(workload)) if indices is None else indices
    return MEASURING[workload.kind].rows(loaded, workload, specs, list(chosen), progress, block_size)


def fill_points(workload: Workload, points: Sequence, rows: Rows) -> Measured:
    """The points (:class:`kvviz.studies.sweep.SweepPoint`, which imports this module) filled from the records of
    every item of ``workload``, and what the report needs besides. The one place a point's measures are written:
    each workload kind computes a :class:`Measures` record per point."""
    measures, measured = MEASURING[workload.kind].measure(workload, rows)
    for point, found in zip(points, measures, strict=True):
        for name in MEASURE_FIELDS:
            setattr(point, name, getattr(found, name))
    return measured


@dataclass
class Measures:
    """What measuring gives one point (every field a :class:`~kvviz.studies.sweep.SweepPoint` field of the same
    name): its first error, or its bytes (the mean over its items), outcomes and the workload's measures with their
    95% intervals. A measure the workload does not have stays None."""

    error: str | None = None
    kv_bytes: int | None = None
    kv_bytes_full: int | None = None
    full_precision_bytes: int | None = None
    factors: dict | None = None
    layout_bytes: dict | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    items_scored: int | None = None
    accuracy: float | None = None
    accuracy_ci: tuple[float, float] | None = None
    agreement_with_full: float | None = None
    agreement_ci: tuple[float, float] | None = None
    worst_prompt_agreement: float | None = None
    mean_kl: float | None = None
    kl_p95: float | None = None
    first_divergence: int | None = None
    perplexity: float | None = None


MEASURE_FIELDS = tuple(f.name for f in fields(Measures))


def cell_of(result: MethodResult, outcome: Outcome | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Cell:
    factors = result.axis_factors
    layouts = result.layout_bytes(block_size)
    return Cell(result.error, result.kv_bytes, result.kv_bytes_full, result.kv_breakdown.full_precision,
                None if factors is None else {"architecture": factors.architecture, "eviction": factors.eviction,
                                              "quantization": factors.quantization},
                outcome, list(result.kl_per_step), result.first_divergence,
                layout_bytes=None if layouts is None else layouts.to_json())


def first_error(cells: list[Cell]) -> str | None:
    return next((c.error for c in cells if c.error), None)


def measured_items(cells: list[Cell], fulls: list[Cell]) -> Measures:
    """What every item-based point reads first: its first error, else its bytes (the mean over its items of what
    its cache and full's held at the end) and outcomes."""
    error = first_error(cells)
    if error is not None:
        return Measures(error=error)
    layouts = None
    if all(c.layout_bytes for c in cells):
        layouts = {name: round(sum(c.layout_bytes[name] for c in cells) / len(cells)) for name in cells[0].layout_bytes}
    return Measures(kv_bytes=round(sum(c.kv_bytes for c in cells) / len(cells)),
                    kv_bytes_full=round(sum(c.kv_bytes_full for c in fulls) / len(fulls)),
                    full_precision_bytes=round(sum(c.full_precision_bytes for c in cells) / len(cells)),
                    factors=cells[0].factors, layout_bytes=layouts, outcomes=[cell.outcome for cell in cells])


def with_accuracy(measures: Measures, full: list[Outcome], groups: list[str] | None) -> Measures:
    """Accuracy over every item and its 95% interval (Wilson; resampling whole groups when items share one), and
    each item's outcome against full's."""
    outcomes = measures.outcomes
    for ours, theirs in zip(outcomes, full, strict=True):
        ours.versus_full = versus(bool(theirs.correct), bool(ours.correct))
    right = sum(bool(o.correct) for o in outcomes)
    return replace(measures, items_scored=len(outcomes), accuracy=right / len(outcomes),
                   accuracy_ci=(wilson(right, len(outcomes)) if groups is None else
                                bootstrap_mean([float(bool(o.correct)) for o in outcomes], groups)))


class TaskMeasuring:
    """A task's items, free-running, all configurations of a wave of items in one batch; each item right or wrong
    under every configuration, with the cause of each failure (the planted spans its cache evicted)."""

    kind: ClassVar[str] = "task"

    def rows(self, loaded: LoadedModel, workload: TaskWorkload, specs: list[str], indices: list[int],
             progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
        items = stream_items(loaded.tokenizer, workload.task, workload.length, indices, workload.seed)
        per_item = decode_prompts(loaded, [item.ids for item in items], specs, NEW_TOKENS[workload.task], FREE,
                                  progress)
        return on_passing_thread(lambda: self._scored(loaded, items, per_item, specs, block_size))

    @staticmethod
    def _scored(loaded: LoadedModel, items: list[TailItem], per_item: list[list[MethodResult]], specs: list[str],
                block_size: int) -> Rows:
        """Each item's cells: its answer checked, the fates of its planted spans, its layouts."""
        quantized = [parse_spec(spec).quantization is not None for spec in specs]
        rows = Rows()
        for item, results in zip(items, per_item, strict=True):
            cells = []
            for result, quantizes in zip(results, quantized, strict=True):
                outcome = None
                if result.error is None:
                    checks = item.score(result.text)
                    fates = span_fates(result.ledger, item.spans)
                    correct = all(checks.values())
                    outcome = Outcome(item.item_id, correct, cause="" if correct else failure_cause(
                        item, checks, fates, quantizes), evicted={f.label: len(f.evicted_layers) for f in fates
                                                                  if f.evicted}, answer=result.text.strip())
                cells.append(cell_of(result, outcome, block_size))
            listing = {"id": item.item_id, "prompt": loaded.tokenizer.decode(item.ids), "expected": item.expected,
                       "depth": item.depth, "full_correct": cells[0].outcome is not None and cells[0].outcome.correct}
            rows.records.append(ItemRecord(listing, len(item.ids), cells))
        return rows

    def measure(self, workload: TaskWorkload, rows: Rows) -> tuple[list[Measures], Measured]:
        full = rows.column(0)
        measures = []
        for index in range(len(rows.records[0].cells) if rows.records else 0):
            cells = rows.column(index)
            found = measured_items(cells, full[:len(cells)])
            if found.error is None:
                found = with_accuracy(found, [cell.outcome for cell in full[:len(cells)]], None)
            measures.append(found)
        right = sum(bool(c.outcome and c.outcome.correct) for c in full)
        notes = [f"The full cache is right on {right} of {len(full)} items ({right / len(full):.0%}); every "
                 "configuration is scored on the items it ran and judged against full item by item."]
        return measures, Measured(rows.mean_tokens(), notes, [record.listing for record in rows.records])


class PromptMeasuring:
    """A prompt set, one batch per wave: teacher-forced agreement and KL on every prompt; with answers also
    free-running outputs scored right or wrong, full's included."""

    kind: ClassVar[str] = "prompt"

    def rows(self, loaded: LoadedModel, workload: PromptWorkload, specs: list[str], indices: list[int],
             progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
        answered = workload.answered
        prompts = [workload.prompts[i] for i in indices]
        per_prompt = decode_prompts(loaded, [p.ids for p in prompts], specs, workload.max_new_tokens,
                                    BOTH if answered else FORCED, progress)
        return on_passing_thread(lambda: self._scored(prompts, per_prompt, answered, block_size))

    @staticmethod
    def _scored(prompts: list[PromptCase], per_prompt: list[list[MethodResult]], answered: bool,
                block_size: int) -> Rows:
        """Each prompt's cells: its answer found (or not), agreement and KL with full, its layouts."""
        rows = Rows()
        for prompt, results in zip(prompts, per_prompt, strict=True):
            cells = [cell_of(result, Outcome(
                prompt.name, answer_found(prompt.answer, result.text) if answered and result.error is None else None,
                result.agreement_with_full, result.mean_kl, answer=result.text.strip() if answered else ""),
                block_size) for result in results]
            listing = {"id": prompt.name, "prompt": prompt.text, "expected": prompt.answer}
            if prompt.group is not None:
                listing["group"] = prompt.group
            rows.records.append(ItemRecord(listing, len(prompt.ids), cells, prompt.group))
        return rows

    def measure(self, workload: PromptWorkload, rows: Rows) -> tuple[list[Measures], Measured]:
        groups = rows.groups()
        full = rows.column(0)
        measures = []
        for column in range(len(rows.records[0].cells) if rows.records else 0):
            cells = rows.column(column)
            found = measured_items(cells, full[:len(cells)])
            if found.error is not None:
                measures.append(found)
                continue
            agreements = [o.agreement for o in found.outcomes]
            ran = None if groups is None else groups[:len(cells)]
            divergences = [c.first_divergence for c in cells if c.first_divergence is not None]
            found = replace(found, agreement_with_full=sum(agreements) / len(agreements),
                            agreement_ci=bootstrap_mean(agreements, ran), worst_prompt_agreement=min(agreements),
                            mean_kl=sum(o.mean_kl for o in found.outcomes) / len(found.outcomes),
                            kl_p95=percentile([kl for c in cells for kl in c.kl_per_step], 0.95),
                            first_divergence=min(divergences) if divergences else None, items_scored=len(cells))
            if workload.answered:
                found = with_accuracy(found, [cell.outcome for cell in full[:len(cells)]], ran)
            measures.append(found)
        notes = []
        if workload.answered:
            right = sum(bool(c.outcome.correct) for c in full)
            notes.append(f"The full cache's output holds the answer on {right} of {len(full)} prompts; every "
                         "configuration is scored on the prompts it ran and judged against full prompt by prompt.")
        if groups is not None:
            notes.append(f"{len(set(groups))} groups of prompts sharing a document: each group is one unit of every "
                         "test, and every interval resamples whole groups.")
        return measures, Measured(workload.sizing_length(), notes, [record.listing for record in rows.records],
                                  groups)


class TextMeasuring:
    """Streaming perplexity of every SPEC on the play (its one item), all of them fed each token in one forward."""

    kind: ClassVar[str] = "text"

    def rows(self, loaded: LoadedModel, workload: TextWorkload, specs: list[str], indices: list[int],
             progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
        """No ledger in a streaming perplexity: no layout bytes (``block_size`` is unused)."""
        try:
            text = play_text(workload.play)
        except LookupError as error:
            raise ValueError(str(error).strip("'\"")) from None
        ids = loaded.tokenizer(text)["input_ids"][: workload.tokens]
        outcomes = streaming_perplexities(loaded, ids, specs, progress)
        cells = [Cell(str(o)) if isinstance(o, SpecError) else Cell(kv_bytes=o.kv_bytes, perplexity=o.ppl)
                 for o in outcomes]
        return Rows([ItemRecord({"id": workload.play}, len(ids), cells)])

    def measure(self, workload: TextWorkload, rows: Rows) -> tuple[list[Measures], Measured]:
        cells = rows.records[0].cells
        full_bytes = cells[0].kv_bytes if cells[0].error is None else None
        measures = [Measures(error=cell.error) if cell.error is not None else
                    Measures(kv_bytes=cell.kv_bytes, kv_bytes_full=full_bytes, perplexity=cell.perplexity)
                    for cell in cells]
        return measures, Measured(rows.records[0].tokens, [])


MEASURING = {m.kind: m for m in (TaskMeasuring(), PromptMeasuring(), TextMeasuring())}
