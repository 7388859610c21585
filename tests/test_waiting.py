"""The engine's line (kvviz.runtime.waiting, applied at every step by kvviz.runtime.engine): fair order across users,
visible positions, cancel, abandoned pages, failures that don't stop the engine, admission at every step."""

import threading
import time

import pytest

from kvviz.runtime.admission import ONE_AT_A_TIME, Admission, RunSize
from kvviz.runtime.engine import Engine
from kvviz.runtime.jobs import Cancelled, Job, Stage, Status, Turn

SMALL = RunSize(10, "cpu")


def gated(gate: threading.Event, value=None, started: list | None = None, name: str = "", steps: int = 1,
          size: RunSize = SMALL) -> Job:
    """A job that holds its place without computing: ``steps`` steps (the model given back between them), each
    ending once ``gate`` is open; it records when each step started."""

    def run(progress):
        for step in range(steps):
            if step:
                yield Turn(size)
            if started is not None:
                started.append(name)
            while not gate.is_set():
                yield Stage.MEASURE
                time.sleep(0.002)
        return value

    return Job(run, size, name)


def done(value=None, record: list | None = None, name: str = "", size: RunSize = SMALL) -> Job:
    return gated(_open(), value, record, name, size=size)


def _open() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


@pytest.fixture
def engine():
    return Engine(None, "cpu", admission=ONE_AT_A_TIME)


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_round_robin_across_users_and_positions(engine):
    gate = threading.Event()
    first = engine.submit(gated(gate, "first"), "alice")
    _wait_for(lambda: first.status is Status.RUNNING)
    started: list[str] = []
    a2, a3 = engine.submit(done("a2", started, "a2"), "alice"), engine.submit(done("a3", started, "a3"), "alice")
    b1 = engine.submit(done("b1", started, "b1"), "bob")
    assert (engine.ahead(a2), engine.ahead(b1), engine.ahead(a3)) == (1, 2, 3)
    gate.set()
    assert [handle.result(5) for handle in (a2, a3, b1)] == ["a2", "a3", "b1"]
    assert started == ["a2", "b1", "a3"], "bob is not stuck behind all of alice's runs"
    assert first.result(5) == "first" and a3.status is Status.DONE and engine.ahead(a3) == 0


def test_cancel_a_waiting_and_a_running_run(engine):
    gate, closed = threading.Event(), []
    blocker = engine.submit(gated(gate, "blocker"), "a")
    waiting = engine.submit(done("never"), "b")
    waiting.cancel()

    def endless(progress):
        try:
            while True:
                yield Stage.DECODE
                time.sleep(0.002)
        finally:
            closed.append(True)

    running = engine.submit(Job(endless, SMALL), "c")
    gate.set()
    _wait_for(lambda: running.status is Status.RUNNING)
    running.cancel()
    assert running.wait(5) and waiting.wait(5)
    assert running.status is Status.CANCELLED and waiting.status is Status.CANCELLED and closed == [True]
    with pytest.raises(Cancelled):
        running.result()
    assert blocker.result(5) == "blocker"


def test_abandoned_runs_free_their_place_and_failures_keep_the_engine_serving(engine):
    gate = threading.Event()
    engine.submit(gated(gate), "a")
    stale = engine.submit(done("never"), "b", abandon_after=0.05)
    time.sleep(0.1)
    gate.set()
    assert stale.wait(5) and stale.status is Status.ABANDONED

    def crash(progress):
        yield Stage.MEASURE
        raise RuntimeError("boom")

    failed = engine.submit(Job(crash, SMALL), "c")
    with pytest.raises(RuntimeError, match="boom"):
        failed.result(5)
    assert failed.status is Status.FAILED
    assert engine.submit(done(42), "c").result(5) == 42


def test_a_running_run_whose_page_stopped_polling_is_abandoned(engine):
    handle = engine.submit(gated(threading.Event()), "gone", abandon_after=0.1)
    assert handle.wait(5) and handle.status is Status.ABANDONED


def test_the_third_of_three_users_is_told_two_runs_are_ahead(engine):
    from kvviz_app.progress_ui import queue_message

    gate = threading.Event()
    first = engine.submit(gated(gate), "alice")
    _wait_for(lambda: first.status is Status.RUNNING)
    second, third = engine.submit(done("b"), "bob"), engine.submit(done("c"), "carol")
    assert (engine.ahead(first), engine.ahead(second), engine.ahead(third)) == (0, 1, 2)
    assert queue_message(engine.ahead(third), third) == "Queued behind 2 other runs…"
    assert queue_message(engine.ahead(second), second) == "Queued behind 1 other run…"
    gate.set()
    assert third.result(5) == "c" and engine.ahead(third) == 0


def test_runs_of_different_users_run_together_one_run_per_user():
    engine = Engine(None, "cpu", admission=Admission(most_runs=3))
    gate, started = threading.Event(), []
    a1, a2 = (engine.submit(gated(gate, name, started, name), "alice") for name in ("a1", "a2"))
    b1, c1 = engine.submit(gated(gate, "b1", started, "b1"), "bob"), engine.submit(gated(gate, "c1", started, "c1"),
                                                                                    "carol")
    _wait_for(lambda: len(started) == 3)
    assert sorted(started) == ["a1", "b1", "c1"], "three users' runs at once"
    assert a2.status is Status.WAITING and engine.ahead(a2) == 3, "alice's second run waits for her first"
    gate.set()
    assert [handle.result(5) for handle in (a1, a2, b1, c1)] == ["a1", "a2", "b1", "c1"]
    assert started[-1] == "a2"


def test_the_engine_remembers_finished_runs_without_their_results(engine):
    result = bytearray(1 << 20)
    handle = engine.submit(done(result), "alice")
    assert handle.result(5) is result
    (record,) = engine.history
    assert (record.user, record.status, record.number) == ("alice", Status.DONE, handle.number)
    assert record.submitted_at <= record.started_at <= record.finished_at
    assert not hasattr(record, "result") and not hasattr(record, "job")


def test_runs_start_as_the_admission_policy_admits_them():
    """On a CPU two short runs start together; the long upload behind them waits until both are done and runs alone,
    and the short run behind it does not overtake it."""
    engine = Engine(None, "cpu", admission=Admission(most_runs=4))
    gate, started = threading.Event(), []
    short, upload = RunSize(80, "cpu"), RunSize(2022 * 6, "cpu")
    handles = [engine.submit(gated(gate, user, started, user, size=size), user)
               for user, size in (("s1", short), ("s2", short), ("upload", upload), ("s3", short))]
    _wait_for(lambda: len(started) == 2)
    time.sleep(0.05)
    assert started == ["s1", "s2"] and handles[2].status is handles[3].status is Status.WAITING
    gate.set()
    for handle in handles:
        handle.result(5)
    assert started == ["s1", "s2", "upload", "s3"]
    upload_run, behind = handles[2], handles[3]
    assert upload_run.started_at >= max(handles[0].finished_at, handles[1].finished_at), "the upload alone"
    assert behind.started_at >= upload_run.finished_at, "the short run behind it waits"


def test_a_long_run_gives_the_model_back_between_steps_and_others_take_turns(engine):
    """Admission at every step: one at a time, a study of three items lets the short runs queued during its first
    item go before its second (its user goes to the back of the round) instead of holding the model throughout."""
    gate, started = threading.Event(), []
    study = engine.submit(gated(gate, "study", started, "study", steps=3), "teacher")
    _wait_for(lambda: started == ["study"])
    shorts = [engine.submit(done(i, started, f"short-{i}"), f"student-{i}") for i in range(2)]
    gate.set()
    assert study.result(5) == "study" and [handle.result(5) for handle in shorts] == [0, 1]
    assert started == ["study", "short-0", "short-1", "study", "study"]
