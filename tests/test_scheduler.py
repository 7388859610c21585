"""The one scheduler (the app's queue, the bench's class): fair order, visible positions, cancel, abandoned pages,
failures that don't stop it."""

import threading
import time

from kvviz.runtime.admission import RunSize
from kvviz.runtime.scheduler import ABANDONED, CANCELLED, DONE, FAILED, Scheduler, Ticket


def _blocker():
    gate = threading.Event()

    def job(progress):
        gate.wait(5)
        return "first"

    return gate, job


def _blocked_queue() -> tuple[Scheduler, threading.Event, Ticket]:
    """A scheduler whose one worker runs alice's first run until the gate opens."""
    queue = Scheduler()
    gate, job = _blocker()
    first = queue.submit("alice", job)
    while first.status != "running":
        time.sleep(0.01)
    return queue, gate, first


def test_round_robin_across_users_and_positions():
    queue, gate, first = _blocked_queue()
    started: list[str] = []

    def record(name):
        def job(progress):
            started.append(name)
            return name
        return job

    a2 = queue.submit("alice", record("a2"))
    a3 = queue.submit("alice", record("a3"))
    b1 = queue.submit("bob", record("b1"))
    assert (queue.position(a2), queue.position(b1), queue.position(a3)) == (1, 2, 3)
    gate.set()
    for ticket in (a2, a3, b1):
        assert ticket.done.wait(5)
    assert started == ["a2", "b1", "a3"], "bob is not stuck behind all of alice's runs"
    assert first.result == "first" and a3.status == DONE and queue.position(a3) == 0


def test_cancel_queued_and_running_runs():
    queue = Scheduler()
    gate, job = _blocker()
    blocker = queue.submit("a", job)
    queued = queue.submit("b", lambda progress: "never")
    queued.cancel()

    def long_job(progress):
        for step in range(1000):
            progress(step / 1000, "working")
            time.sleep(0.005)
        return "finished"

    running = queue.submit("c", long_job)
    gate.set()
    while running.status != "running":
        time.sleep(0.01)
    running.cancel()
    assert running.done.wait(5) and queued.done.wait(5)
    assert running.status == CANCELLED and queued.status == CANCELLED
    assert blocker.status == DONE


def test_abandoned_runs_free_their_slot_and_failures_keep_the_worker_alive():
    queue = Scheduler(abandon_after=0.05)
    gate, job = _blocker()
    queue.submit("a", job)
    stale = queue.submit("b", lambda progress: "never")
    time.sleep(0.1)
    gate.set()
    assert stale.done.wait(5) and stale.status == ABANDONED

    def crash(progress):
        raise RuntimeError("boom")

    failed = queue.submit("c", crash)
    assert failed.done.wait(5) and failed.status == FAILED and "boom" in failed.error
    after = queue.submit("c", lambda progress: 42)
    assert after.done.wait(5) and after.result == 42


def test_a_running_job_whose_page_stopped_polling_is_abandoned():
    queue = Scheduler(abandon_after=0.1)

    def long_job(progress):
        for _ in range(500):
            progress(0.5, "working")
            time.sleep(0.01)
        return "finished"

    ticket = queue.submit("gone", long_job)
    assert ticket.done.wait(5) and ticket.status == ABANDONED


def test_the_third_of_three_users_is_told_two_runs_are_ahead():
    from kvviz_app.progress_ui import queue_message

    queue, gate, first = _blocked_queue()
    second = queue.submit("bob", lambda progress: "b")
    third = queue.submit("carol", lambda progress: "c")
    assert (queue.ahead(first), queue.ahead(second), queue.ahead(third)) == (0, 1, 2)
    assert queue_message(queue.ahead(third), third) == "Queued behind 2 other runs…"
    assert queue_message(queue.ahead(second), second) == "Queued behind 1 other run…"
    gate.set()
    assert third.done.wait(5) and queue.ahead(third) == 0


def test_runs_of_different_users_run_together_one_run_per_user():
    queue = Scheduler(together=3)
    gate = threading.Event()
    started: list[str] = []

    def blocking(name):
        def job(progress):
            started.append(name)
            gate.wait(5)
            return name
        return job

    a1, a2 = queue.submit("alice", blocking("a1")), queue.submit("alice", blocking("a2"))
    b1, c1 = queue.submit("bob", blocking("b1")), queue.submit("carol", blocking("c1"))
    deadline = time.monotonic() + 5
    while len(started) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(started) == ["a1", "b1", "c1"], "three users' runs at once"
    assert a2.status == "queued" and queue.ahead(a2) == 3, "alice's second run waits for her first"
    gate.set()
    for ticket in (a1, a2, b1, c1):
        assert ticket.done.wait(5) and ticket.status == DONE
    assert started[-1] == "a2"


def test_the_queue_remembers_finished_runs_without_their_results():
    queue = Scheduler()
    result = bytearray(1 << 20)
    ticket = queue.submit("alice", lambda progress: result)
    assert ticket.done.wait(5) and ticket.result is result
    (record,) = queue.history
    assert (record.user, record.status, record.number) == ("alice", DONE, ticket.number)
    assert record.submitted_at <= record.started_at <= record.finished_at
    assert not hasattr(record, "result") and not hasattr(record, "job")


def test_the_queue_starts_runs_as_the_admission_policy_admits_them():
    """On a CPU two short comparisons start together; the long upload behind them waits until both are done and runs
    alone, and the short run behind it does not overtake it."""
    queue = Scheduler(together=4)
    gate = threading.Event()
    running: list[set[str]] = []
    now: set[str] = set()

    def blocking(name):
        def job(progress):
            now.add(name)
            running.append(set(now))
            gate.wait(5)
            time.sleep(0.05)
            now.discard(name)
            return name
        return job

    short, upload = RunSize(80, "cpu"), RunSize(2022 * 6, "cpu")
    tickets = [queue.submit(user, blocking(user), size) for user, size in
               (("s1", short), ("s2", short), ("upload", upload), ("s3", short))]
    deadline = time.monotonic() + 5
    while len(running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(running) == 2 and {"s1", "s2"} in running, "the two short runs together"
    assert tickets[2].status == tickets[3].status == "queued"
    gate.set()
    for ticket in tickets:
        assert ticket.done.wait(5) and ticket.status == DONE
    assert running[2:] == [{"upload"}, {"s3"}], "the upload alone, then the short run behind it"


def test_a_closed_scheduler_serves_what_it_was_given_then_its_workers_end():
    queue = Scheduler(together=2)
    gate, job = _blocker()
    tickets = [queue.submit("a", job), queue.submit("b", lambda progress: "b"), queue.submit("a", lambda progress: 1)]
    queue.close()
    gate.set()
    for ticket in tickets:
        assert ticket.done.wait(5) and ticket.status == DONE
    for worker in queue._workers:
        worker.join(5)
        assert not worker.is_alive()
