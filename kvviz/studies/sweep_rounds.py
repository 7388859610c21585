"""A sweep measured in rounds: every open point and full take the next items, decided points stop, and the run ends
when every point is decided, the item cap or the time budget is reached, or a prompt set is used up.

After each round every open point's anytime-valid p-values on the main measure go through the design fixed before
the run (:class:`kvviz.studies.sequential.Design`: margin, families, order), and
:class:`~kvviz.studies.sequential.Allocation` stops the points it decides, as the simulations that prove the error
rates do (:mod:`kvviz.studies.simulation`). A point's share of the next round goes to the points still open: each
round measures full and the open points only. Full is scored on every item any point used.

A fixed design is one round of every item. Each round's rows are kept in a store under the workload, the SPECs it
ran and its items: a sweep asked again with a larger cap replays the same rounds from the store (the same items,
the same decisions) and goes on where the first stopped, which is legitimate for tests valid under optional stopping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.paired import unit_differences
from kvviz.studies.sequential import ROUND_ITEMS, STOPS, Allocation, claim_p_values
from kvviz.studies.sweep_measure import Cell, ItemRecord, Rows, measure_rows, unit_order
from kvviz.studies.sweep_shards import ModelKey, ShardKey, ShardRun, ShardStore, stream_key
from kvviz.studies.verdicts import outcome_values, sweep_design
from kvviz.studies.workloads import TaskWorkload, Workload

# Measures these items (indices) under these SPECs (full first): in process, or in shards on a cluster
RoundSource = Callable[[list[str], list[int], Progress | None], tuple[Rows, ShardRun | None]]
# The page's time budget: rounds end by it, and the page draws the results a few seconds later, within a class's
# three minutes on the 2-core CPU. Its late rounds run full and one or two open points, so the last seconds buy the
# most items: 150 s reached 112 items on a slow morning, about what proves kivi:bits=8 within 5 points (110).
DEFAULT_SECONDS = 165.0
DEFAULT_MAX_ITEMS = 256


@dataclass(frozen=True)
class Adaptive:
    """An adaptive sweep's limits: at most ``max_items`` items, no new round once ``seconds`` have passed or the
    next round would likely run past them (None: no time budget); rounds of ``round_items`` items."""

    max_items: int = DEFAULT_MAX_ITEMS
    seconds: float | None = DEFAULT_SECONDS
    round_items: int = ROUND_ITEMS

    def check(self) -> None:
        """ValueError with one line for limits a sweep cannot run under, before any model work."""
        if self.max_items < 1:
            raise ValueError(f"--max-items {self.max_items}: an adaptive sweep needs at least one item")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"--time-budget {self.seconds:g}: give a number of seconds above 0")


@dataclass
class Allocated:
    """One point's share of the run: the items it used, why it stopped (``within``, ``beyond``, ``worse``, or
    ``cap`` when the run ended first) and the look it stopped at (counted from 1; the last look for ``cap``)."""

    items_used: int = 0
    stopped: str | None = None
    look: int | None = None


@dataclass
class RoundsRun:
    """How a sweep's rounds went: how many, the items full was scored on, why the run ended (``decided``,
    ``cap``, ``time``, ``used up``, or ``fixed`` for the one round of a fixed design), the rounds found in the
    store, seconds, and each point's allocation in the points' order (full's first)."""

    rounds: int = 0
    items: int = 0
    ended: str = "fixed"
    reused: int = 0
    seconds: float = 0.0
    allocation: list[Allocated] = field(default_factory=list)
    shard_run: ShardRun | None = None

    def describe(self) -> str:
        ends = {"decided": "every point decided", "cap": "the item cap reached", "time": "the time budget spent",
                "used up": "the prompt set used up", "fixed": "one look at every item"}
        reused = f", {self.reused} from the store" if self.reused else ""
        return (f"{self.rounds} round{'s' if self.rounds != 1 else ''} ({self.items} items{reused}) in "
                f"{self.seconds:.1f} s: {ends[self.ended]}")

    def to_json(self) -> dict:
        """What the rounds did (their seconds are the report's own)."""
        return {"rounds": self.rounds, "items": self.items, "ended": self.ended, "reused": self.reused}


def _merge(first: ShardRun | None, second: ShardRun | None) -> ShardRun | None:
    if first is None or second is None:
        return first or second
    return ShardRun(second.address, second.workers, first.shards + second.shards,
                    first.shards_reused + second.shards_reused, first.shard_seconds + second.shard_seconds)


def in_process(loaded: LoadedModel, workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE,
               store: ShardStore | None = None) -> RoundSource:
    """Each round's items measured here, each round kept in ``store`` (when given) under its items and SPECs, and
    read back from it when a sweep asks for the same round again."""
    model: ModelKey = loaded

    def measure(specs: list[str], indices: list[int], progress: Progress | None) -> tuple[Rows, ShardRun | None]:
        key = ShardKey(stream_key(workload), tuple(specs), tuple(indices), block_size)
        found = None if store is None else store.load(model, key)
        if found is not None:
            found.reused = True
            return found, None
        rows = measure_rows(loaded, workload, specs, indices, progress, block_size)
        if store is not None:
            store.save(model, key, rows)
        return rows, None

    return measure


def measure_in_rounds(workload: Workload, points: Sequence, source: RoundSource, main_key: str, threshold: float,
                      margin: float, adaptive: Adaptive | None, progress: Progress | None = None) -> tuple[Rows,
                                                                                                          RoundsRun]:
    """Every point's rows, round after round (module docstring), and how the rounds went. ``points[0]`` is full;
    without ``adaptive``, one round of every item."""
    started = time.perf_counter()
    specs = [p.spec for p in points]
    units = _units(workload, adaptive)
    run = RoundsRun(allocation=[Allocated() for _ in points])
    rows = Rows()
    allocation = Allocation(sweep_design(points, range(1, len(points)), margin))  # every point but full is judged
    open_points = list(range(len(points)))  # full stays open while any other point is
    next_unit = 0
    per_item = None  # the last round's seconds per item: an upper bound for the next, which runs no more points
    while True:
        size = len(units) - next_unit if adaptive is None else adaptive.round_items
        taken = units[next_unit: next_unit + size]
        taken = _whole_items(taken, adaptive, run.items)
        if not taken:
            run.ended = "used up" if adaptive is not None else run.ended
            break
        indices = [i for unit in taken for i in unit]
        running = [specs[i] for i in open_points]
        if adaptive is not None and adaptive.seconds is not None and per_item is not None:
            if time.perf_counter() - started + per_item * len(indices) > adaptive.seconds:
                run.ended = "time"
                break
        round_started = time.perf_counter()
        report = _round_progress(progress, run, adaptive, len(open_points) - 1, len(points) - 1)
        measured, shard_run = source(running, indices, report)
        run.shard_run = _merge(run.shard_run, shard_run)
        run.reused += measured.reused
        for record in measured.records:
            by_spec = dict(zip(running, record.cells, strict=True))
            rows.records.append(ItemRecord(record.listing, record.tokens, [by_spec.get(s) for s in specs],
                                           record.group))
        per_item = (time.perf_counter() - round_started) / len(indices)
        next_unit += len(taken)
        run.rounds += 1
        run.items += len(indices)
        for i in open_points:
            run.allocation[i].items_used = run.items
        if adaptive is None:
            break
        decided = _look(rows, allocation, main_key, threshold)
        for i in decided:
            run.allocation[i].stopped, run.allocation[i].look = decided[i], run.rounds
        open_points = [0] + [i for i in open_points[1:] if i not in decided]
        if len(open_points) == 1:
            run.ended = "decided"
            break
        if run.items >= adaptive.max_items:
            run.ended = "cap"
            break
    if adaptive is not None:
        for i in open_points[1:]:
            run.allocation[i].stopped, run.allocation[i].look = "cap", run.rounds
    run.seconds = time.perf_counter() - started
    return rows, run


def _units(workload: Workload, adaptive: Adaptive | None) -> list[tuple[int, ...]]:
    """The units in the order the rounds use them: a task's endless stream up to the cap when adaptive."""
    if adaptive is not None and isinstance(workload, TaskWorkload):
        return [(index,) for index in range(adaptive.max_items)]
    return unit_order(workload)


def _whole_items(taken: list[tuple[int, ...]], adaptive: Adaptive | None, used: int) -> list[tuple[int, ...]]:
    """The round's units cut to the item cap (whole units: a group is never split; the first always comes)."""
    if adaptive is None:
        return taken
    kept, count = [], used
    for unit in taken:
        if kept and count + len(unit) > adaptive.max_items:
            break
        kept.append(unit)
        count += len(unit)
    return kept if used < adaptive.max_items else []


def _look(rows: Rows, allocation: Allocation, main_key: str, threshold: float) -> dict[int, str]:
    """One look after a round: each judged point's units so far into the design; the points (by index, full 0) it
    newly decides, with why (a point whose item failed stops as ``error``; the report names the failure)."""
    full_cells = rows.column(0)
    groups = rows.groups()
    differences, failed = [], set()
    for judged in range(allocation.open.shape[1]):
        cells = rows.column(judged + 1)
        values = _values(cells, main_key, threshold)
        full = _values(full_cells[:len(cells)], main_key, threshold)
        if values is None or full is None:
            failed.add(judged)
            differences.append(unit_differences([], []))
            continue
        differences.append(unit_differences(full, values, None if groups is None else groups[:len(values)]))
    was_open = allocation.open[0].copy()
    allocation.look(claim_p_values(differences, allocation.design.margin))
    decided = {j + 1: STOPS[int(allocation.stops[0, j])] for j in np.nonzero(was_open & ~allocation.open[0])[0]}
    for judged in failed:
        if was_open[judged]:
            allocation.open[0, judged] = False
            decided[judged + 1] = "error"
    return decided


def _values(cells: list[Cell], main_key: str, threshold: float) -> list | None:
    if any(cell.error is not None or cell.outcome is None for cell in cells):
        return None
    return outcome_values([cell.outcome for cell in cells], main_key, threshold)


def _round_progress(progress: Progress | None, run: RoundsRun, adaptive: Adaptive | None, still_open: int,
                    judged: int) -> Progress | None:
    """The round's progress as a share of the run: of the item cap (or the time budget, when that ends sooner)."""
    if progress is None:
        return None
    if adaptive is None:
        return progress
    start = min(1.0, run.items / adaptive.max_items)
    end = min(1.0, (run.items + adaptive.round_items) / adaptive.max_items)
    label = f"round {run.rounds + 1}: {still_open} of {judged} points open, {run.items} items so far: "

    def report(share: float, message: str) -> None:
        progress(start + (end - start) * share, label + message)

    return report

