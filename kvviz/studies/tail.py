"""The tail risk: multi-key, multi-value and multi-hop retrieval and system-prompt instructions, per method.

A method can pass the single needle and still lose a distractor-laden key, one of several values, one hop of a
chain or one instruction of a system prompt. Each task family plants statements in kvviz's seeded filler
(:func:`kvviz.studies.needle.filler_sentences`) at chosen depths of a prompt of a chosen length, records every planted
span as token positions, asks a question, and scores the greedy answer exactly:

- ``needle``: the single pass key of :mod:`kvviz.studies.needle`, the reference the others are read against;
- ``multikey``: several similar keys, one asked for (the others are distractors, as in RULER's multi-key needle);
- ``multivalue``: one key with several values, all asked for (correct only when every value is given);
- ``vartrack``: a chain of k assignments (``A = 48213``, ``B = A``, ...) in reading order from the chosen depth,
  the last variable asked for; the answer starts ``Following the chain: <last> =`` so each hop is a copy;
- ``instructions``: three checkable instructions in the system prompt, a long user context and a question; each
  instruction is scored on its own.

Calibration: ``full`` runs every item first, and an item (for ``instructions``, an instruction) counts only where
the full cache gets it right, so a failure is the method's, not the model's; the report says how many were generated
and kept. Attribution: for every planted span, the eviction ledger says whether it was evicted, the earliest step
and the layers; a failure with nothing planted evicted under a quantized stack is marked as quantization's.

Items are built in :mod:`kvviz.studies.tail_items`, attribution in :mod:`kvviz.studies.tail_attribution`; this module
runs the methods on them and reports.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field

from kvviz.comparison.session import PromptError, PromptSession, capture_for, reference_first
from kvviz.methods import MethodStack, parse_spec
from kvviz.runtime.admission import ALONE
from kvviz.runtime.jobs import Job, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress, share
from kvviz.studies.needle import check_grid, split_for_mode
from kvviz.studies.tail_attribution import SpanFate, evicted_share, failure_cause, span_fates
from kvviz.studies.tail_items import (
    MAX_HOPS,
    NEW_TOKENS,
    PROTECT,
    TASKS,
    TailItem,
    check_hops,
    generate_items,
    task_label,
)


@dataclass
class TailCell:
    """One method (with or without protection) on one calibrated item.

    ``checks``: each expected value or instruction with whether the answer met it (for ``instructions`` only the
    instructions the full cache followed). ``score``: the share of checks met for ``instructions``, else 1.0 when all
    are met. ``cause`` of a failure: ``evicted`` (a planted span the answer needed left the cache), ``quantization``
    (nothing planted was evicted and the stack quantizes), ``not evicted`` (the planted tokens all stayed: the
    method lost something else). ``evicted_share``: for failures, per prompt token the share of (layer, KV head)
    entries evicted by the end (what the page marks).
    """

    item_id: str
    task: str
    hops: int
    length: int
    depth: float
    trial: int
    mode: str
    method: str  # the SPEC's label, with " [protect NAME]" when protected
    spec: str
    protect: str
    answer: str
    checks: dict[str, bool]
    score: float
    correct: bool
    cause: str
    lost: list[str]  # labels of the planted spans evicted from some layer and KV head
    spans: list[SpanFate]
    prompt_tokens: int
    kv_bytes: int
    evicted_share: list[float] | None = None

    @property
    def label(self) -> str:
        return task_label(self.task, self.hops)


@dataclass
class TailReport:
    """Calibrated cells of every method on every item; ``calibration`` says what was generated and kept per task."""

    cells: list[TailCell]
    calibration: list[dict]
    items: list[TailItem]
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    def to_frame(self):
        """One row per cell, with a ``task_label`` column (``vartrack k=2``) and the lost spans joined."""
        import pandas as pd

        rows = [asdict(c) | {"task_label": c.label} for c in self.cells]
        return pd.DataFrame(rows, columns=[*TailCell.__dataclass_fields__, "task_label"])

    def summary(self) -> list[dict]:
        """Per task (label) and method: items kept, accuracy (mean score), and how many failures had evictions."""
        groups: dict[tuple, list[TailCell]] = {}
        for cell in self.cells:
            groups.setdefault((cell.label, cell.method), []).append(cell)
        return [{"task": task, "method": method, "items": len(cells),
                 "accuracy": round(sum(c.score for c in cells) / len(cells), 4),
                 "failures": sum(not c.correct for c in cells),
                 "failures_evicted": sum(c.cause == "evicted" for c in cells)}
                for (task, method), cells in groups.items()]

    def to_json(self) -> dict:
        return {"settings": self.settings, "seconds": round(self.seconds, 3), "calibration": self.calibration,
                "summary": self.summary(), "cells": [asdict(c) for c in self.cells],
                "items": [asdict(i) for i in self.items]}

    def lines(self) -> list[str]:
        """The report as text: calibration, accuracy per method and task (* = a failure lost a planted span to
        eviction), then every failure with what the ledger says it lost."""
        out = [f"tail tasks ({self.settings['mode']}), {self.seconds:.1f}s; calibration (full right / generated):",
               "  " + ", ".join(f"{c['task']} {c['kept']}/{c['generated']}"
                                f"{' instr.' if c['unit'] == 'instructions' else ''}" for c in self.calibration)]
        rows = self.summary()
        tasks = list(dict.fromkeys(r["task"] for r in rows))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        table = {(r["task"], r["method"]): r for r in rows}
        width = max(len(m) for m in methods) + 2
        out += ["", "accuracy on kept items (* = some failure lost a planted span to eviction)",
                f"{'method':<{width}}" + "".join(f"{t:>16}" for t in tasks)]
        for method in methods:
            marks = [("-" if row is None else f"{row['accuracy']:.0%} ({row['items']})"
                      f"{'*' if row['failures_evicted'] else ''}") for row in (table.get((t, method)) for t in tasks)]
            out.append(f"{method:<{width}}" + "".join(f"{m:>16}" for m in marks))
        lost = [c for c in self.cells if not c.correct]
        out += ["", "failures:"] if lost else []
        for cell in lost:
            where = "; ".join(f"{f.label} at step {f.evicted_step} in {len(f.evicted_layers)} layers"
                              for f in cell.spans if f.evicted)
            out.append(f"  {cell.method} on {cell.item_id}: {cell.cause}{': ' + where if where else ''}; "
                       f"answer {cell.answer.strip()[:60]!r}")
        return out


def check_tail(specs: list[str], tasks: list[str], lengths: list[int], depths: list[float], hops: list[int],
               trials: int, mode: str, protect: list[str]) -> None:
    """PromptError or SpecError naming the first argument of a tail run that cannot run, before any model work."""
    check_grid("tail", mode, specs, lengths, depths, trials)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise PromptError(f"unknown task(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASKS)}")
    check_hops(hops)
    if any(name not in PROTECT for name in protect):
        raise PromptError(f"unknown protection {', '.join(protect)}; choose from {', '.join(PROTECT)}")
    for spec in specs:
        parse_spec(spec)


@dataclass
class Calibration:
    """Per task label, what full was asked and what it got right (``instructions`` count per instruction)."""

    counts: dict[str, list[int]] = field(default_factory=dict)  # label -> [generated, kept]

    def judge(self, item: TailItem, checks: dict[str, bool]) -> set[str]:
        """The checks of ``item`` that count (those full met: all of them or none, except per instruction), and
        the item counted."""
        kept = {key for key, ok in checks.items() if ok} if item.instructions else (
            set(checks) if all(checks.values()) else set())
        count = self.counts.setdefault(item.label, [0, 0])
        count[0] += len(checks) if item.instructions else 1
        count[1] += len(kept) if item.instructions else int(bool(kept))
        return kept

    def rows(self) -> list[dict]:
        return [{"task": label, "generated": g, "kept": k, "unit": "instructions" if label == "instructions"
                 else "items"} for label, (g, k) in self.counts.items()]


def run_tail(
    loaded: LoadedModel,
    specs: list[str],
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    hops: list[int] | None = None,
    trials: int = 1,
    seed: int = 0,
    mode: str = "query_aware",
    protect: list[str] | None = None,
    progress: Progress | None = None,
) -> TailReport:
    """Calibrate every item on ``full``, then run every method (and, for each ``protect`` name, every eviction
    method again with those spans protected) on the items full got right.

    One prefill per item is shared by all methods. PromptError or SpecError for bad arguments, before any model
    work. One job on the model's engine (:func:`tail_job`), whose result this waits for.
    """
    return loaded.engine.run(tail_job(loaded, specs, tasks, lengths, depths, hops, trials, seed, mode, protect),
                             progress)


def tail_job(loaded: LoadedModel, specs: list[str], tasks: list[str], lengths: list[int], depths: list[float],
             hops: list[int] | None = None, trials: int = 1, seed: int = 0, mode: str = "query_aware",
             protect: list[str] | None = None) -> Job[TailReport]:
    """:func:`run_tail` as a job: the arguments checked and the items generated here, then one item per step,
    decoded alone, the model given back between items so that other runs take their turns."""
    hops = list(hops or range(1, MAX_HOPS + 1))
    protect = list(protect or [])
    check_tail(specs, tasks, lengths, depths, hops, trials, mode, protect)
    stacks = reference_first(specs)
    runs = [(stack, "") for stack in stacks]
    runs += [(stack, name) for name in protect for stack in stacks if stack.label != "full"
             and stack.eviction is not None]
    items = generate_items(loaded.tokenizer, tasks, lengths, depths, hops, trials, seed)
    settings = {"model": loaded.name, "methods": [s.label for s in stacks], "tasks": tasks, "lengths": lengths,
                "depths": depths, "hops": hops, "trials": trials, "seed": seed, "mode": mode, "protect": protect}
    return Job(functools.partial(_tail_steps, loaded, runs, capture_for(stacks), items, settings), ALONE, "tail")


def _tail_steps(loaded: LoadedModel, runs: list[tuple[MethodStack, str]], capture, items: list[TailItem],
                settings: dict, progress: Progress) -> Steps[TailReport]:
    started = time.perf_counter()
    cells: list[TailCell] = []
    calibration = Calibration()
    for number, item in enumerate(items):
        yield Turn(ALONE) if number else Stage.MEASURE
        report = share(progress, number / len(items), (number + 1) / len(items),
                       f"{item.label}, {item.length} tokens: ")
        cells += _run_item(loaded, item, runs, capture, settings["mode"], calibration, report)
    progress(1.0, "done")
    return TailReport(cells, calibration.rows(), items, time.perf_counter() - started, settings)


def _run_item(loaded: LoadedModel, item: TailItem, runs: list[tuple[MethodStack, str]], capture, mode: str,
              calibration: Calibration, progress: Progress | None) -> list[TailCell]:
    """Every run on one item after one prefill, full first: it decides which checks count (none: the item is
    skipped)."""
    context, suffix = split_for_mode(item.ids, item.question_start, mode)
    session = PromptSession(loaded, context)
    session.prefill(capture)
    counted: set[str] | None = None
    cells = []
    for index, (stack, name) in enumerate(runs):
        if progress is not None:
            progress(index / len(runs), f"{stack.label}{' protected' if name else ''}")
        result, _ = session.run(stack, NEW_TOKENS[item.task], suffix_tokens=suffix,
                                protect=item.protect_spans(name) if name else None)
        checks = item.score(result.text)
        if counted is None:  # full runs first
            counted = calibration.judge(item, checks)
            if not counted:
                return []
        cells.append(_cell(item, stack, name, mode, result, {k: ok for k, ok in checks.items() if k in counted},
                           len(context)))
    return cells


def _cell(item: TailItem, stack: MethodStack, name: str, mode: str, result, checks: dict[str, bool],
          context_length: int) -> TailCell:
    """One method's cell on a calibrated item: its score and, for a failure, what its ledger says it lost."""
    correct = all(checks.values())
    score = sum(checks.values()) / len(checks) if item.instructions else float(correct)
    fates = span_fates(result.ledger, item.spans)
    cause = "" if correct else failure_cause(item, checks, fates, stack.quantization is not None)
    share_evicted = (evicted_share(result.ledger, context_length)
                     if not correct and result.ledger is not None else None)
    return TailCell(item.item_id, item.task, item.hops, item.length, item.depth, item.trial, mode,
                    stack.label + (f" [protect {name}]" if name else ""), stack.label, name, result.text, checks,
                    round(score, 4), correct, cause, [f.label for f in fates if f.evicted], fates, len(item.ids),
                    result.kv_bytes, share_evicted)
