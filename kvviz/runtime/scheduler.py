"""The one scheduler of runs on a server's models: the app's pages, the class bench and the load test submit to it.

Page loads and cached results never touch it; only runs that need the model do. ``together`` long-lived worker
threads start up to that many runs at once, at most one per user, as the engine's admission policy admits them
(:mod:`kvviz.runtime.admission`: on a CPU short comparisons start together and a long upload's comparison alone, so
decoding together does not make the class wait longer than one at a time). A worker is only a run's client side: the
run hands every piece of model work to the model's engine (:mod:`kvviz.runtime.engine`, one long-lived thread per
model, which runs every forward), so comparisons in progress decode in one running batch, joining it at the next
step boundary. Order is round-robin across users (each user's runs FIFO), so a student who queues five comparisons
does not starve the others, and nobody waits behind more than one run of each other user; the next run in that order
that the policy does not admit yet waits for runs in progress to finish, and nobody overtakes it. Users see their
position, can cancel (queued runs leave at once, a running one stops at its next progress report, which in a batch is
its next decode step), and a run whose page stopped polling (the browser went away) is dropped, queued or running.
The bench's class (``kvviz.bench.sections.classroom``) serves its students through this same class, so its figures
measure the queue the app runs.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvviz.runtime.admission import ADMISSION, Admission, RunSize
from kvviz.runtime.progress import Progress

QUEUED, RUNNING, DONE, FAILED, CANCELLED, ABANDONED = "queued", "running", "done", "failed", "cancelled", "abandoned"
FINISHED = (DONE, FAILED, CANCELLED, ABANDONED)


class Cancelled(Exception):
    """Raised inside a run when its user cancelled it."""


Job = Callable[[Progress], Any]
ErrorFormatter = Callable[[BaseException], str]


@dataclass
class Ticket:
    """A user's handle on one queued run."""

    user: str
    job: Job = field(repr=False)
    size: RunSize = field(default_factory=RunSize)  # what the admission policy weighs (nothing declared: counts only)
    number: int = 0
    status: str = QUEUED
    fraction: float = 0.0
    message: str = "waiting"
    result: Any = None
    error: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the worker took it (None if it never ran)
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def touch(self) -> None:
        """The page is still polling: keep this run."""
        self.last_seen = time.monotonic()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class FinishedRun:
    """What the queue remembers of a finished run: who and when, never its result (a long-lived server would
    otherwise hold the last thousand comparisons, their jobs and everything those close over)."""

    user: str
    number: int
    status: str
    submitted_at: float
    started_at: float | None
    finished_at: float


class Scheduler:
    """Round-robin queue with ``together`` workers (runs at once, one per user) starting runs as ``admission``
    admits them; ``abandon_after`` seconds without ``touch`` drops a run (None: never, for callers that do not poll)."""

    def __init__(self, abandon_after: float | None = 30.0, format_error: ErrorFormatter | None = None,
                 history: int = 1000, together: int = 1, admission: Admission = ADMISSION):
        self.abandon_after = abandon_after
        self.admission = admission
        self.history: deque[FinishedRun] = deque(maxlen=history)  # oldest first: waits and fairness
        self.format_error = format_error or (lambda error: f"{type(error).__name__}: {error}")
        self._lock = threading.Condition()
        self._per_user: OrderedDict[str, deque[Ticket]] = OrderedDict()
        self._numbers = itertools.count(1)
        self._running: list[Ticket] = []
        self.most_at_once = 0  # the most runs that were in progress at once
        self._closing = False
        self._workers = [threading.Thread(target=self._work, name=f"kvviz-run-queue-{i}", daemon=True)
                         for i in range(max(1, together))]
        for worker in self._workers:
            worker.start()

    def submit(self, user: str, job: Job, size: RunSize | None = None) -> Ticket:
        """Queue ``job`` for ``user``; ``size`` (the run's, :meth:`kvviz.runs.RunRequest.run_size`) is what the
        admission policy weighs."""
        ticket = Ticket(user=user, job=job, size=size or RunSize(), number=next(self._numbers))
        with self._lock:
            self._per_user.setdefault(user, deque()).append(ticket)
            self._lock.notify_all()
        return ticket

    def position(self, ticket: Ticket) -> int:
        """0 while running or finished; otherwise its place in line (1 = starts next)."""
        with self._lock:
            order = self._planned_order()
            return order.index(ticket) + 1 if ticket.status == QUEUED and ticket in order else 0

    def ahead(self, ticket: Ticket) -> int:
        """Runs ahead of this one: those running now plus the queued runs before it (0 once it runs or finished)."""
        with self._lock:
            order = self._planned_order()
            if ticket.status != QUEUED or ticket not in order:
                return 0
            return order.index(ticket) + len(self._running)

    def _planned_order(self) -> list[Ticket]:
        """The order queued runs will start in: one per user per round, users in arrival order."""
        queues = [list(q) for q in self._per_user.values()]
        order: list[Ticket] = []
        for round_ in itertools.zip_longest(*queues):
            order.extend(t for t in round_ if t is not None)
        return order

    def close(self) -> None:
        """Let the workers end once the runs queued and in progress are done (a bench's class, served once)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()

    def _next(self) -> Ticket | None:
        with self._lock:
            while True:
                self._drop_stale()
                if self._closing and not self._per_user:
                    return None
                running_users = {ticket.user for ticket in self._running}
                user = next((user for user in self._per_user if user not in running_users), None)
                if user is not None and self.admission.admits([ticket.size for ticket in self._running],
                                                              self._per_user[user][0].size):
                    # the first user in the round without a run in progress, whose run the policy admits now
                    queue = self._per_user.pop(user)
                    ticket = queue.popleft()
                    if queue:  # this user goes to the back of the round
                        self._per_user[user] = queue
                    ticket.status, ticket.started_at = RUNNING, time.monotonic()
                    self._running.append(ticket)
                    self.most_at_once = max(self.most_at_once, len(self._running))
                    return ticket
                self._lock.wait(timeout=1.0)

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for user in list(self._per_user):
            keep = deque()
            for ticket in self._per_user[user]:
                if ticket.cancel_requested:
                    self._finish(ticket, CANCELLED, error="cancelled")
                elif self._abandoned(ticket, now):
                    self._finish(ticket, ABANDONED, error="the page went away")
                else:
                    keep.append(ticket)
            if keep:
                self._per_user[user] = keep
            else:
                del self._per_user[user]

    def _abandoned(self, ticket: Ticket, now: float) -> bool:
        return self.abandon_after is not None and now - ticket.last_seen > self.abandon_after

    def _finish(self, ticket: Ticket, status: str, result: Any = None, error: str | None = None) -> None:
        ticket.status, ticket.result, ticket.error = status, result, error
        ticket.fraction = 1.0 if status == DONE else ticket.fraction
        ticket.finished_at = time.monotonic()
        self.history.append(FinishedRun(ticket.user, ticket.number, status, ticket.submitted_at, ticket.started_at,
                                        ticket.finished_at))
        ticket.done.set()

    def _work(self) -> None:
        while (ticket := self._next()) is not None:

            def report(fraction: float, message: str, ticket: Ticket = ticket) -> None:
                if ticket.cancel_requested or self._abandoned(ticket, time.monotonic()):
                    raise Cancelled
                ticket.fraction, ticket.message = fraction, message

            try:
                result = ticket.job(report)
            except Cancelled:
                if ticket.cancel_requested:
                    self._finish(ticket, CANCELLED, error="cancelled")
                else:
                    self._finish(ticket, ABANDONED, error="the page went away")
            except Exception as error:  # noqa: BLE001 - a failing run must never stop the worker
                self._finish(ticket, FAILED, error=self.format_error(error))
            else:
                self._finish(ticket, DONE, result=result)
            finally:
                with self._lock:
                    self._running.remove(ticket)
                    self._lock.notify_all()
