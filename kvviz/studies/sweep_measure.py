"""Measuring a sweep's points on each kind of workload: every configuration of every item or prompt in one running
batch, every configuration of a play in one streaming forward per token.

Measuring is two steps so that a sweep can be cut into shards (:mod:`kvviz.studies.sweep_shards`): decoding some of
a workload's items under every configuration gives :class:`Rows` (one small :class:`Cell` per item and configuration,
no ledgers or tensors, so a shard is cheap to store and to send between machines); :func:`fill_points` reads the rows
of every item, in item order, into the points (``full`` first, the reference) and returns what the report needs
besides: the prompt length, notes, and the items or prompts it scored. Rows joined from shards fill the same points
as rows measured in one go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.engine.batched import decode_prompts
from kvviz.engine.results import MethodResult
from kvviz.engine.session import BOTH, FORCED, FREE
from kvviz.methods import SpecError, parse_spec
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.intervals import bootstrap_mean, percentile, wilson
from kvviz.studies.perplexity import play_text, streaming_perplexities
from kvviz.studies.tail_attribution import failure_cause, span_fates
from kvviz.studies.tail_items import NEW_TOKENS, spread_items
from kvviz.studies.workloads import PromptWorkload, TaskWorkload, TextWorkload, Workload, answer_found


@dataclass
class Outcome:
    """One item (or prompt) under one configuration. ``correct``: for tasks and answered prompts; ``agreement`` and
    ``mean_kl``: teacher-forced on full's tokens, for prompts. ``evicted``: each planted span the cache evicted from
    some layer, with how many layers evicted it; ``cause`` of a failure as the Tail risk page gives it."""

    item: str
    correct: bool | None = None
    agreement: float | None = None
    mean_kl: float | None = None
    cause: str = ""
    evicted: dict[str, int] = field(default_factory=dict)
    answer: str = ""


@dataclass
class Measured:
    """What measuring a workload leaves besides the points: the prompt length, notes, and the items scored (id,
    prompt text, expected answer), listed once for the whole sweep."""

    prompt_tokens: int
    notes: list[str]
    items: list[dict] = field(default_factory=list)


@dataclass
class Cell:
    """One item under one configuration, reduced to what its point reads: bytes, the outcome (for tasks only on
    items full got right), per-step KL and first divergence (prompts), perplexity (a play), or the error."""

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
class Rows:
    """Some items of a workload measured under every configuration: per item its listing (id, prompt, expected),
    whether it is kept (scored: full got it right), its prompt tokens and one :class:`Cell` per configuration."""

    listing: list[dict] = field(default_factory=list)
    kept: list[bool] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cells: list[list[Cell]] = field(default_factory=list)

    @classmethod
    def join(cls, parts: Sequence[Rows]) -> Rows:
        """The rows of several shards as one, in the order given (the items' order)."""
        joined = cls()
        for part in parts:
            joined.listing += part.listing
            joined.kept += part.kept
            joined.tokens += part.tokens
            joined.cells += part.cells
        return joined


def item_count(workload: Workload) -> int:
    """How many items a workload has: a task's items, a set's prompts, and a play is one stream (one item)."""
    if isinstance(workload, TaskWorkload):
        return workload.items
    if isinstance(workload, PromptWorkload):
        return len(workload.prompts)
    return 1


def measure_rows(loaded: LoadedModel, workload: Workload, specs: list[str], indices: Sequence[int] | None = None,
                 progress: Progress | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """Every SPEC (``full`` first) on the items at ``indices`` (all when None), as :class:`Rows`; layouts page in
    blocks of ``block_size`` token slots."""
    chosen = range(item_count(workload)) if indices is None else indices
    return ROWS_OF[workload.kind](loaded, workload, specs, list(chosen), progress, block_size)


def fill_points(workload: Workload, points: list, rows: Rows) -> Measured:
    """The points filled from the rows of every item of ``workload``, and what the report needs besides."""
    return FILL_OF[workload.kind](workload, points, rows)


def cell_of(result: MethodResult, outcome: Outcome | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Cell:
    factors = result.axis_factors
    layouts = result.layout_bytes(block_size)
    return Cell(result.error, result.kv_bytes, result.kv_bytes_full, result.kv_breakdown.full_precision,
                None if factors is None else {"architecture": factors.architecture, "eviction": factors.eviction,
                                              "quantization": factors.quantization},
                outcome, list(result.kl_per_step), result.first_divergence,
                layout_bytes=None if layouts is None else layouts.to_json())


def fill_bytes(point, cells: list[Cell], fulls: list[Cell]) -> None:
    """A point's bytes: the mean over its items of what its cache and full's held at the end."""
    point.kv_bytes = round(sum(c.kv_bytes for c in cells) / len(cells))
    point.kv_bytes_full = round(sum(c.kv_bytes_full for c in fulls) / len(fulls))
    point.full_precision_bytes = round(sum(c.full_precision_bytes for c in cells) / len(cells))
    point.factors = cells[0].factors
    if all(c.layout_bytes for c in cells):
        point.layout_bytes = {name: round(sum(c.layout_bytes[name] for c in cells) / len(cells))
                              for name in cells[0].layout_bytes}


def first_error(cells: list[Cell]) -> str | None:
    return next((c.error for c in cells if c.error), None)


def fill_accuracy(point, outcomes: list[Outcome]) -> None:
    """Accuracy, its Wilson interval and the number of items scored, over the outcomes that have a verdict (the
    items or prompts full got right)."""
    scored = [o for o in outcomes if o.correct is not None]
    right = sum(o.correct for o in scored)
    point.items_scored = len(scored)
    point.accuracy = right / len(scored) if scored else None
    point.accuracy_ci = wilson(right, len(scored))


def task_rows(loaded: LoadedModel, workload: TaskWorkload, specs: list[str], indices: list[int],
              progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """The task's items at ``indices``, free-running, all configurations of a wave of items in one batch; an item
    is kept (scored) only where full answers it right."""
    every = spread_items(loaded.tokenizer, workload.task, workload.length, workload.items, workload.seed)
    items = [every[i] for i in indices]
    per_item = decode_prompts(loaded, [item.ids for item in items], specs, NEW_TOKENS[workload.task], FREE, progress)
    quantized = [parse_spec(spec).quantization is not None for spec in specs]
    rows = Rows()
    for item, results in zip(items, per_item, strict=True):
        kept = results[0].error is None and all(item.score(results[0].text).values())
        cells = []
        for result, quantizes in zip(results, quantized, strict=True):
            outcome = None
            if kept and result.error is None:
                checks = item.score(result.text)
                fates = span_fates(result.ledger, item.spans)
                correct = all(checks.values())
                outcome = Outcome(item.item_id, correct, cause="" if correct else failure_cause(
                    item, checks, fates, quantizes), evicted={f.label: len(f.evicted_layers) for f in fates
                                                              if f.evicted}, answer=result.text.strip())
            cells.append(cell_of(result, outcome, block_size))
        rows.listing.append({"id": item.item_id, "prompt": loaded.tokenizer.decode(item.ids),
                             "expected": item.expected, "depth": item.depth, "kept": kept})
        rows.kept.append(kept)
        rows.tokens.append(len(item.ids))
        rows.cells.append(cells)
    return rows


def fill_task(workload: TaskWorkload, points: list, rows: Rows) -> Measured:
    """Accuracy of every point on the items full got right, with each item's outcome and its cause."""
    kept = [cells for cells, keep in zip(rows.cells, rows.kept, strict=True) if keep]
    for index, point in enumerate(points):
        point.error = first_error([cells[index] for cells in rows.cells])
        if point.error is not None or not kept:
            continue
        cells = [row[index] for row in kept]
        fill_bytes(point, cells, [row[0] for row in kept])
        point.outcomes = [cell.outcome for cell in cells]
        fill_accuracy(point, point.outcomes)
    if not kept:
        for point in points:
            point.error = point.error or "the full cache got no item right at these settings: nothing to score"
    notes = [f"{len(kept)} of {len(rows.cells)} items kept: the full cache got them right (the others are not "
             "scored)"]
    return Measured(round(sum(rows.tokens) / len(rows.tokens)), notes, rows.listing)


def prompt_rows(loaded: LoadedModel, workload: PromptWorkload, specs: list[str], indices: list[int],
                progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """The prompts at ``indices`` in one batch per wave: teacher-forced agreement and KL on every prompt; with
    answers also free-running outputs, a prompt kept for accuracy where full's output holds its answer."""
    answered = workload.answered
    prompts = [workload.prompts[i] for i in indices]
    per_prompt = decode_prompts(loaded, [p.ids for p in prompts], specs, workload.max_new_tokens,
                                BOTH if answered else FORCED, progress)
    rows = Rows()
    for prompt, results in zip(prompts, per_prompt, strict=True):
        kept = answered and results[0].error is None and answer_found(prompt.answer, results[0].text)
        rows.cells.append([cell_of(result, Outcome(
            prompt.name, answer_found(prompt.answer, result.text) if kept else None, result.agreement_with_full,
            result.mean_kl, answer=result.text.strip() if answered else ""), block_size) for result in results])
        rows.listing.append({"id": prompt.name, "prompt": prompt.text, "expected": prompt.answer})
        rows.kept.append(kept)
        rows.tokens.append(len(prompt.ids))
    return rows


def fill_prompts(workload: PromptWorkload, points: list, rows: Rows) -> Measured:
    """Agreement, KL and their tails of every point over every prompt; with answers, accuracy on the kept ones."""
    for column, point in enumerate(points):
        cells = [row[column] for row in rows.cells]
        point.error = first_error(cells)
        if point.error is not None:
            continue
        fill_bytes(point, cells, [row[0] for row in rows.cells])
        point.outcomes = [cell.outcome for cell in cells]
        agreements = [o.agreement for o in point.outcomes]
        point.agreement_with_full = sum(agreements) / len(agreements)
        point.agreement_ci = bootstrap_mean(agreements)
        point.worst_prompt_agreement = min(agreements)
        point.mean_kl = sum(o.mean_kl for o in point.outcomes) / len(point.outcomes)
        point.kl_p95 = percentile([kl for c in cells for kl in c.kl_per_step], 0.95)
        divergences = [c.first_divergence for c in cells if c.first_divergence is not None]
        point.first_divergence = min(divergences) if divergences else None
        point.items_scored = len(cells)
        if workload.answered:
            fill_accuracy(point, point.outcomes)
    notes = []
    if workload.answered:
        kept = sum(rows.kept)
        notes.append(f"{kept} of {len(rows.cells)} prompts kept for accuracy: the full cache's output holds their "
                     "answer (agreement and KL cover every prompt)")
        if not kept:
            for point in points:
                point.error = point.error or "the full cache answered no prompt right: nothing to score"
    return Measured(workload.sizing_length(), notes, rows.listing)


def text_rows(loaded: LoadedModel, workload: TextWorkload, specs: list[str], indices: list[int],
              progress: Progress | None, block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """Streaming perplexity of every SPEC on the play (its one item), all of them fed each token in one forward
    (no ledger: no layout bytes)."""
    try:
        text = play_text(workload.play)
    except LookupError as error:
        raise ValueError(str(error).strip("'\"")) from None
    ids = loaded.tokenizer(text)["input_ids"][: workload.tokens]
    outcomes = streaming_perplexities(loaded, ids, specs, progress)
    cells = [Cell(str(o)) if isinstance(o, SpecError) else Cell(kv_bytes=o.kv_bytes, perplexity=o.ppl)
             for o in outcomes]
    return Rows([], [False], [len(ids)], [cells])


def fill_text(workload: TextWorkload, points: list, rows: Rows) -> Measured:
    """Each point's perplexity and bytes, full's bytes beside them."""
    cells = rows.cells[0]
    full_bytes = cells[0].kv_bytes if cells[0].error is None else None
    for point, cell in zip(points, cells, strict=True):
        if cell.error is not None:
            point.error = cell.error
            continue
        point.kv_bytes, point.kv_bytes_full, point.perplexity = cell.kv_bytes, full_bytes, cell.perplexity
    return Measured(rows.tokens[0], [])


ROWS_OF = {"task": task_rows, "prompt": prompt_rows, "text": text_rows}
FILL_OF = {"task": fill_task, "prompt": fill_prompts, "text": fill_text}
