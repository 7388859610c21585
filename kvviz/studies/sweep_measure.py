"""Measuring a sweep's points on each kind of workload: every configuration of every item or prompt in one running
batch, every configuration of a play in one streaming forward per token.

Each function fills the points it is given (``full`` first, the reference) and returns what the report needs
besides: the prompt length, notes, and the items or prompts it scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from kvviz.studies.workloads import PromptWorkload, TaskWorkload, TextWorkload, answer_found


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


def fill_bytes(point, results: list[MethodResult], fulls: list[MethodResult]) -> None:
    """A point's bytes: the mean over its items of what its cache and full's held at the end."""
    point.kv_bytes = round(sum(r.kv_bytes for r in results) / len(results))
    point.kv_bytes_full = round(sum(r.kv_bytes_full for r in fulls) / len(fulls))
    point.full_precision_bytes = round(sum(r.kv_breakdown.full_precision for r in results) / len(results))
    factors = results[0].axis_factors
    if factors is not None:
        point.factors = {"architecture": factors.architecture, "eviction": factors.eviction,
                         "quantization": factors.quantization}


def first_error(results: list[MethodResult]) -> str | None:
    return next((r.error for r in results if r.error), None)


def fill_accuracy(point, outcomes: list[Outcome]) -> None:
    """Accuracy, its Wilson interval and the number of items scored, over the outcomes that have a verdict (the
    items or prompts full got right)."""
    scored = [o for o in outcomes if o.correct is not None]
    right = sum(o.correct for o in scored)
    point.items_scored = len(scored)
    point.accuracy = right / len(scored) if scored else None
    point.accuracy_ci = wilson(right, len(scored))


def measure_task(loaded: LoadedModel, workload: TaskWorkload, points: list, progress: Progress | None) -> Measured:
    """Every point on the task's items, free-running, all configurations of a wave of items in one batch; an item
    counts only where full answers it right."""
    items = spread_items(loaded.tokenizer, workload.task, workload.length, workload.items, workload.seed)
    per_item = decode_prompts(loaded, [item.ids for item in items], [p.spec for p in points],
                              NEW_TOKENS[workload.task], FREE, progress)
    kept = [(item, results) for item, results in zip(items, per_item, strict=True)
            if results[0].error is None and all(item.score(results[0].text).values())]
    for index, point in enumerate(points):
        results = [results[index] for _, results in kept]
        point.error = first_error([r[index] for r in per_item])
        if point.error is not None or not kept:
            continue
        quantized = parse_spec(point.spec).quantization is not None
        outcomes = []
        for (item, _), result in zip(kept, results, strict=True):
            checks = item.score(result.text)
            fates = span_fates(result.ledger, item.spans)
            correct = all(checks.values())
            outcomes.append(Outcome(item.item_id, correct, cause="" if correct else failure_cause(
                item, checks, fates, quantized), evicted={f.label: len(f.evicted_layers) for f in fates if f.evicted},
                answer=result.text.strip()))
        fill_bytes(point, results, [r[0] for _, r in kept])
        fill_accuracy(point, outcomes)
        point.outcomes = outcomes
    if not kept:
        for point in points:
            point.error = point.error or "the full cache got no item right at these settings: nothing to score"
    listed = [{"id": item.item_id, "prompt": loaded.tokenizer.decode(item.ids), "expected": item.expected,
               "depth": item.depth, "kept": any(item is k for k, _ in kept)} for item in items]
    notes = [f"{len(kept)} of {len(items)} items kept: the full cache got them right (the others are not scored)"]
    return Measured(round(sum(len(item.ids) for item in items) / len(items)), notes, listed)


def measure_prompts(loaded: LoadedModel, workload: PromptWorkload, points: list,
                    progress: Progress | None) -> Measured:
    """Every point on every prompt in one batch per wave: teacher-forced agreement and KL on every prompt; with
    answers also free-running outputs, scored on the prompts whose answer full's output holds."""
    answered = workload.answered
    prompts = workload.prompts
    per_prompt = decode_prompts(loaded, [p.ids for p in prompts], [p.spec for p in points], workload.max_new_tokens,
                                BOTH if answered else FORCED, progress)
    kept = [answered and results[0].error is None and answer_found(prompt.answer, results[0].text)
            for prompt, results in zip(prompts, per_prompt, strict=True)]
    for column, point in enumerate(points):
        results = [row[column] for row in per_prompt]
        point.error = first_error(results)
        if point.error is not None:
            continue
        fill_bytes(point, results, [row[0] for row in per_prompt])
        point.outcomes = [Outcome(prompt.name, answer_found(prompt.answer, result.text) if scored else None,
                                  result.agreement_with_full, result.mean_kl,
                                  answer=result.text.strip() if answered else "")
                          for prompt, result, scored in zip(prompts, results, kept, strict=True)]
        agreements = [o.agreement for o in point.outcomes]
        point.agreement_with_full = sum(agreements) / len(agreements)
        point.agreement_ci = bootstrap_mean(agreements)
        point.worst_prompt_agreement = min(agreements)
        point.mean_kl = sum(o.mean_kl for o in point.outcomes) / len(point.outcomes)
        point.kl_p95 = percentile([kl for r in results for kl in r.kl_per_step], 0.95)
        divergences = [r.first_divergence for r in results if r.first_divergence is not None]
        point.first_divergence = min(divergences) if divergences else None
        point.items_scored = len(prompts)
        if answered:
            fill_accuracy(point, point.outcomes)
    notes = []
    if answered:
        notes.append(f"{sum(kept)} of {len(prompts)} prompts kept for accuracy: the full cache's output holds their "
                     "answer (agreement and KL cover every prompt)")
        if not any(kept):
            for point in points:
                point.error = point.error or "the full cache answered no prompt right: nothing to score"
    listed = [{"id": p.name, "prompt": p.text, "expected": p.answer} for p in prompts]
    return Measured(workload.sizing_length(), notes, listed)


def measure_text(loaded: LoadedModel, workload: TextWorkload, points: list, progress: Progress | None) -> Measured:
    """Streaming perplexity of every point on the play, all of them fed each token in one forward."""
    try:
        text = play_text(workload.play)
    except LookupError as error:
        raise ValueError(str(error).strip("'\"")) from None
    ids = loaded.tokenizer(text)["input_ids"][: workload.tokens]
    outcomes = streaming_perplexities(loaded, ids, [p.spec for p in points], progress)
    full_bytes = outcomes[0].kv_bytes if not isinstance(outcomes[0], SpecError) else None
    for point, outcome in zip(points, outcomes, strict=True):
        if isinstance(outcome, SpecError):
            point.error = str(outcome)
            continue
        point.kv_bytes, point.kv_bytes_full, point.perplexity = outcome.kv_bytes, full_bytes, outcome.ppl
    return Measured(len(ids), [])
