"""How long a class waits on one server, projected from measured per-run times.

One model serves everybody, taking turns between students, and students who ask for the same thing (a lesson step)
share one run. Served one run at a time (as the model's engine serves runs its admission policy does not let decode
together, :mod:`kvviz.runtime.admission`), when a whole class presses Run at once the k-th run in the queue starts
after the k-1 runs before it: the projection here. Runs admitted together are measured, not projected (the bench's
classroom section serves both ways). Given the seconds each run takes on some machine (measured by
``python -m kvviz bench --sections classroom`` there, e.g. on a GPU through ``scripts/gpu_check.sh``), this module
says what the class would wait on that machine; ``tests/test_load.py`` measures the same waits on real Streamlit
sessions, on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ClassRun:
    """One run in the queue: its seconds on the machine and how many students wait for it (a shared lesson step)."""

    label: str
    seconds: float
    students: int = 1


@dataclass(frozen=True)
class ClassWait:
    """A class pressing Run at once. Waits count until a run starts (as the load test measures them); ``done``
    until the last student has a result."""

    students: int
    runs: int
    seconds_per_run: float  # mean over the runs
    wait_p50: float
    wait_p95: float
    wait_max: float
    done: float


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value at ``fraction`` of the sorted values (nearest rank below, so p95 of 26 runs is the 24th)."""
    ordered = sorted(values)
    return ordered[int(fraction * (len(ordered) - 1))]


def queue_waits(seconds: Sequence[float]) -> list[float]:
    """Each run's wait before it starts, when all are queued at once and run one after another in this order."""
    waits, elapsed = [], 0.0
    for run_seconds in seconds:
        waits.append(elapsed)
        elapsed += run_seconds
    return waits


def project_class(runs: Sequence[ClassRun]) -> ClassWait:
    """The class's waits when every run is queued at once, in the given order (the queue's turn order).

    Waits are per run, like the load test's (students sharing a run share its wait)."""
    if not runs:
        raise ValueError("a class needs at least one run")
    seconds = [run.seconds for run in runs]
    waits = queue_waits(seconds)
    return ClassWait(students=sum(run.students for run in runs), runs=len(runs),
                     seconds_per_run=sum(seconds) / len(seconds), wait_p50=percentile(waits, 0.5),
                     wait_p95=percentile(waits, 0.95), wait_max=waits[-1], done=sum(seconds))
