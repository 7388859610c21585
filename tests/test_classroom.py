"""The class-of-30 projection: a queue that serves one run at a time, from per-run seconds measured on a machine."""

import pytest

from kvviz.planning.classroom import ClassRun, percentile, project_class, queue_waits


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
