"""What the engine runs, as data: a job's steps, what each step asks of the engine, and the handle a client holds.

A client (a page, a lesson, a study, the command line, the benchmark, a notebook) submits a :class:`Job` to its
model's engine (:mod:`kvviz.runtime.engine`) and gets a :class:`Handle`: the run's :class:`Status`, its stage and
progress, ``cancel()``, and its result or error. A job's steps are a generator the engine advances between the
forwards of its running batch. Each value a step yields is a request to the engine:

- a :class:`Stage` says what the run does next (a boundary where other runs' work may come first);
- :class:`SharedPrefill` asks for prompts prefilled in the engine's shared prefill, in a forward with other runs'
  prompts; the engine sends back each prompt's prefill;
- :class:`Decode` puts decode groups in the running batch; the steps resume when every group is finished;
- :class:`Turn` gives the model back: the run waits in line again, and is admitted again with the size it names;
- :class:`Elsewhere` hands work that does not run on this model (a Ray cluster's shards) to a thread of its own:
  the run holds no place in the engine while it waits.

A step that raises fails its run (the handle keeps the error); a cancelled run's steps are closed at the next step
boundary (their ``finally`` blocks run) and its decode groups leave the batch before the next forward.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvviz.runtime.admission import RunSize
from kvviz.runtime.batch import DecodeGroup
from kvviz.runtime.prefix import PrefixCache
from kvviz.runtime.progress import Progress

T = TypeVar("T")


class Status(enum.Enum):
    """Where a run is in its life."""

    WAITING = "waiting"  # in the engine's line: not admitted yet, or given the model back for its next turn
    RUNNING = "running"  # admitted: its steps run between the running batch's forwards
    ELSEWHERE = "elsewhere"  # waiting for work off this model (a cluster): it holds no place in the engine
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"  # its page stopped asking for it (the browser went away)

    @property
    def finished(self) -> bool:
        return self in (Status.DONE, Status.FAILED, Status.CANCELLED, Status.ABANDONED)


class Stage(enum.Enum):
    """What a running job does next: a comparison prefills, forks, decodes in the batch and scores; a study
    measures one item per step."""

    PREFILL = "prefill"
    FORK = "fork"
    DECODE = "decode"
    SCORE = "score"
    MEASURE = "measure"


@dataclass
class SharedPrefill:
    """Prompts for the engine's shared prefill (nobody records their attention): the engine sends back one
    :class:`~kvviz.runtime.prefill.PrefixPrefill` per prompt, in order, or raises the first failure in the steps.

    ``prefix``: blocks the job prefilled itself for these prompts to start from (read, never written), in place of
    the model's prefix cache: what a batch of prompts shares, prefilled once (:mod:`kvviz.comparison.batched`)."""

    prompts: list[list[int]]
    reuse_prefix: bool
    prefix: PrefixCache | None = None


@dataclass
class Decode:
    """Decode groups for the running batch; the steps resume once all are finished, or get the first group's
    error raised in them."""

    groups: list[DecodeGroup]


@dataclass
class Turn:
    """The model given back between two steps: the run waits in line again and resumes when the engine admits
    ``size`` (its next step's) beside the runs then in progress."""

    size: RunSize


@dataclass
class Elsewhere(Generic[T]):
    """Work that does not run on this model: ``work(stop)`` runs on a thread of its own while the run holds no
    place in the engine; ``stop`` is set when the run is cancelled. Its result is sent back to the steps (its
    exception raised in them) once the run is admitted again. Runs that ``work`` submits to this engine are the
    same user's, and are cancelled with it."""

    work: Callable[[threading.Event], T]


Ask = Stage | SharedPrefill | Decode | Turn | Elsewhere
Steps = Generator[Ask, Any, T]


@dataclass(frozen=True)
class Job(Generic[T]):
    """A run as the engine sees it: ``start(progress)`` makes its steps (``progress`` reports to its handle),
    ``size`` is what admission weighs for its first step (:mod:`kvviz.runtime.admission`)."""

    start: Callable[[Progress], Steps]
    size: RunSize
    label: str = ""


class Cancelled(Exception):
    """A run that was cancelled or abandoned has no result."""


@dataclass(eq=False)
class Handle(Generic[T]):
    """A client's hold on one submitted job. Status, stage and progress are read from any thread; the engine sets
    them. ``abandon_after``: seconds without :meth:`touch` after which the engine drops the run (a page that stopped
    polling); None for callers that wait without polling."""

    job: Job[T]
    user: str
    number: int
    abandon_after: float | None = None
    listener: Progress | None = field(default=None, repr=False)  # told of every report, on the engine's thread
    status: Status = Status.WAITING
    stage: Stage | None = None
    fraction: float = 0.0
    message: str = "waiting"
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when it was first admitted (None if it never ran)
    finished_at: float | None = None
    last_seen: float = field(default_factory=time.monotonic)
    _value: T | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _wake: Callable[[], None] = field(default=lambda: None, repr=False)  # the engine's: look at this run now

    @property
    def size(self) -> RunSize:
        return self.job.size

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop the run: a waiting one leaves the line, a running one stops at its next step boundary (in the
        batch: before the next forward)."""
        self._cancel.set()
        self._wake()

    def touch(self) -> None:
        """The client is still there (a page polling): keep the run."""
        self.last_seen = time.monotonic()

    def report(self, fraction: float, message: str) -> None:
        """The job's progress: how far it has got, and what it is doing."""
        self.fraction, self.message = fraction, message
        if self.listener is not None:
            self.listener(fraction, message)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the run finished within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> T:
        """The run's result once it finished: its error raised here if it failed, :class:`Cancelled` if it was
        cancelled or abandoned; TimeoutError if it is still going after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.number} still {self.status.value} after {timeout} s")
        if self.status is Status.DONE:
            return self._value  # type: ignore[return-value]
        if self.status is Status.FAILED:
            raise self.error  # type: ignore[misc]
        raise Cancelled("cancelled" if self.status is Status.CANCELLED else "the page went away")

    def finish(self, status: Status, value: T | None = None, error: BaseException | None = None) -> None:
        """Set by the engine, once: the run's outcome."""
        self.status, self._value, self.error = status, value, error
        self.fraction = 1.0 if status is Status.DONE else self.fraction
        self.finished_at = time.monotonic()
        self._done.set()


@dataclass(frozen=True)
class FinishedRun:
    """What the engine remembers of a finished run: who and when, never its result (a long-lived server would
    otherwise hold its last thousand comparisons)."""

    user: str
    number: int
    status: Status
    submitted_at: float
    started_at: float | None
    finished_at: float

    @classmethod
    def of(cls, handle: Handle) -> FinishedRun:
        return cls(handle.user, handle.number, handle.status, handle.submitted_at, handle.started_at,
                   handle.finished_at or time.monotonic())
