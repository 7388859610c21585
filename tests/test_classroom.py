"""The class-of-30 projection: a queue that serves one run at a time, from per-run seconds measured on a machine; and
a class served both ways, one at a time and as the server admits runs together."""

import time
from types import SimpleNamespace

import pytest

from kvviz.bench.harness import Section
from kvviz.bench.sections.classroom import add_served_class
from kvviz.planning.classroom import ClassRun, percentile, project_class, queue_waits
from kvviz.runs import RunRequest
from kvviz.runtime.admission import CPU_POSITIONS, RunSize
from kvviz.runtime.engine import Engine
from kvviz.runtime.jobs import Job, Stage


def test_each_run_waits_for_every_run_queued_before_it():
    assert queue_waits([2.0, 3.0, 1.0]) == [0.0, 2.0, 5.0]


def test_percentiles_take_the_nearest_rank_below():
    waits = [float(i) for i in range(26)]  # the load test's 26 runs
    assert percentile(waits, 0.5) == 12.0 and percentile(waits, 0.95) == 23.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0, "sorted first"


def test_a_shared_lesson_run_counts_its_students_once_in_the_queue():
    runs = [ClassRun("lesson step 1", 4.0, students=5)] + [ClassRun("comparison", 1.0)] * 25
    wait = project_class(runs)
    assert (wait.students, wait.runs) == (30, 26)
    assert wait.done == pytest.approx(29.0) and wait.wait_max == pytest.approx(28.0)
    assert wait.wait_p50 == pytest.approx(4.0 + 11) and wait.wait_p95 == pytest.approx(4.0 + 22)
    assert wait.seconds_per_run == pytest.approx(29.0 / 26)


def test_a_class_without_runs_is_refused():
    with pytest.raises(ValueError, match="at least one run"):
        project_class([])


class _Run(RunRequest):
    """A run that only takes a little time, of a given size."""

    def __init__(self, positions: int, log: list[str]):
        self.positions, self.log = positions, log

    def job(self, loaded) -> Job:
        return Job(self.steps, RunSize(self.positions, loaded.device))

    def steps(self, progress):
        self.log.append("run")
        started = time.monotonic()
        while time.monotonic() - started < 0.02:
            yield Stage.MEASURE
            time.sleep(0.002)


def _served(positions: int, runs: int = 3, repeats: int = 2) -> tuple[dict, int]:
    """A class of ``runs`` such runs served both ways: its figures by name, and how many runs computed."""
    loaded = SimpleNamespace(device="cpu", engine=Engine(None, "cpu"))
    computed: list[str] = []
    section = Section("classroom", "")
    add_served_class(section, "upload", loaded, [_Run(positions, computed) for _ in range(runs)], "a class", print,
                repeats)
    return {figure.name: figure for figure in section.figures}, len(computed)


def test_a_class_the_server_admits_together_is_served_both_ways():
    figures, computed = _served(100)
    assert computed == 2 * 2 * 3
    assert "(at most 3 at once here)" in figures["upload_together_wait_p50"].note


def test_a_class_whose_runs_the_server_starts_alone_is_served_one_at_a_time_once():
    """Served together it would be the very same schedule: only the machine's noise would differ."""
    figures, computed = _served(CPU_POSITIONS + 1)
    assert computed == 2 * 3
    assert figures["upload_together_wait_p50"].value == figures["upload_one_at_a_time_wait_p50"].value
    assert figures["upload_wait_p50_together_vs_one_at_a_time"].value == 1.0
    assert "by construction" in figures["upload_wait_p50_together_vs_one_at_a_time"].note
