"""One engine per loaded model: the loop that owns scheduling and runs every forward on the model.

Its shape is a serving engine's core loop: schedule, execute, update. Clients (pages, lessons, studies, the command
line, the benchmark, notebooks) submit jobs (:mod:`kvviz.runtime.jobs`) and hold handles; everything else is the
engine's, on one long-lived thread:

- **schedule**: cancelled and abandoned runs leave; waiting runs are admitted in turn (:mod:`kvviz.runtime.waiting`,
  fair across users, one run in progress per user) while the admission policy (:mod:`kvviz.runtime.admission`)
  lets them in beside the runs in progress. Admission is asked at every step: a study that gives the model back
  between items is admitted again for its next one.
- **execute**: every admitted run that waits for nothing runs its steps up to what they ask next: a prefill with a
  capture, a fork, scoring, a study's item, all between two forwards of the batch.
- **forward**: the prompts runs wait on go through one shared prefill (:mod:`kvviz.runtime.together`), then every
  admitted run's decode groups take one step in one forward (:func:`kvviz.runtime.batch.step_groups`): a run joins
  the running batch at the next step and leaves after the step it finishes or is cancelled at.
- **update**: runs whose prefill or decode is done are ready for their next steps.

A run waiting on work off this model (a sweep's shards on a Ray cluster) holds no place meanwhile: its work runs on
a thread of its own, and the run is admitted again when it returns.

Why one thread, not one per run and not a process: torch's CPU kernels run on OpenMP (GNU libgomp in the PyPI
wheels), which gives every thread that starts parallel work a pool of helper threads of its own, kept until that
thread exits; once the pools of all live threads hold more threads than the machine has CPUs, helpers stop spinning
between kernels and each kernel waits for its helpers to wake. Model work on one long-lived thread keeps one pool,
for the whole server, so it computes on every core run after run; and glibc's malloc, which gives each allocating
thread an arena of its own and keeps what a run freed there, finds the next run's tensors in the same arena
(docs/architecture.md, docs/performance.md). A process of its own was measured against this thread (the bench's
``engine_process`` section): it ran a comparison no faster, took seconds to start and a second copy of torch and the
model in memory, and would carry every result, progress report and cancellation over a pipe; the engine's work holds
the interpreter lock only between kernels, so a thread leaves the server's other threads free. The thread exits
after :data:`IDLE_SECONDS` without work (a model dropped from a server's cache is then freed) and starts again on
demand. A model loads on a thread that exits when it is ready, taking the load's pool with it; another thread can
still start parallel work beside the engine (a page's script thread), so on a small CPU a decode step's and a fork's
small kernels run on one thread (:mod:`kvviz.runtime.threads`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from kvviz.runtime.admission import ADMISSION, Admission
from kvviz.runtime.batch import DecodeGroup, step_groups
from kvviz.runtime.jobs import Decode, Elsewhere, FinishedRun, Handle, Job, SharedPrefill, Stage, Status, Steps, Turn
from kvviz.runtime.prefill import PrefixPrefill, prefill_together
from kvviz.runtime.prefix import PrefixCache
from kvviz.runtime.progress import Progress
from kvviz.runtime.threads import small_work
from kvviz.runtime.together import prefill_share
from kvviz.runtime.waiting import WaitingLine

T = TypeVar("T")
IDLE_SECONDS = 60.0  # an engine thread without work for this long exits (a new one starts with the next work)
HISTORY = 1000  # finished runs remembered (who and when: waits and fairness)
LOOK_SECONDS = 1.0  # how often an engine with nothing to run looks at the runs waiting elsewhere (abandoned pages)


class _Run:
    """A submitted job inside the engine: its handle, its steps once started, its size now, what its steps wait for
    and what to hand them when they resume."""

    def __init__(self, handle: Handle):
        self.handle = handle
        self.size = handle.job.size
        self.steps: Steps | None = None
        self.asked: SharedPrefill | Decode | None = None  # what the steps wait for (None: ready to run on)
        self.prefilled: list[PrefixPrefill | BaseException | None] = []
        self.send: Any = None
        self.throw: BaseException | None = None
        self.stop = threading.Event()  # set when the run is cancelled while its work runs elsewhere
        self.children: list[Handle] = []  # runs its work elsewhere submitted here


class Engine:
    """A loaded model's engine (each :class:`~kvviz.runtime.models.LoadedModel` builds one): :meth:`submit` and
    :meth:`run` from any thread; the forwards run on the engine's thread."""

    def __init__(self, model: torch.nn.Module, device: str, prefix_cache: PrefixCache | None = None,
                 admission: Admission = ADMISSION, idle_seconds: float = IDLE_SECONDS):
        self.model, self.device, self.prefix_cache = model, device, prefix_cache
        self.admission, self.idle_seconds = admission, idle_seconds
        self._lock = threading.Condition()
        self._line = WaitingLine()
        self._running: list[_Run] = []
        self._runs: dict[Handle, _Run] = {}
        self._elsewhere: dict[threading.Thread, _Run] = {}
        self._numbers = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.history: deque[FinishedRun] = deque(maxlen=HISTORY)
        self.forwards = self.shared_forwards = 0  # decode forwards, and those that fed more than one run
        self.prefills = self.shared_prefills = 0  # shared-prefill forwards, and those that fed more than one run
        self.seconds = 0.0  # wall seconds in decode steps (the bench splits a class's time with it)

    # clients

    def submit(self, job: Job[T], user: str | None = None, abandon_after: float | None = None,
               listener: Progress | None = None) -> Handle[T]:
        """Put ``job`` in line for ``user`` (None: a line of its own) and return its handle. ``abandon_after``:
        seconds without :meth:`Handle.touch` before the run is dropped; ``listener`` hears every progress report,
        on the engine's thread. A job submitted by work running elsewhere for a run is that run's user's."""
        return self.submit_all([job], [user], abandon_after, listener)[0]

    def submit_all(self, jobs: Sequence[Job], users: Sequence[str | None] | None = None,
                   abandon_after: float | None = None, listener: Progress | None = None) -> list[Handle]:
        """Several jobs put in line at once, so that the next schedule sees them all."""
        with self._lock:
            parent = self._elsewhere.get(threading.current_thread())
            handles = []
            for job, user in zip(jobs, users or [None] * len(jobs), strict=True):
                number = next(self._numbers)
                owner = parent.handle.user if parent is not None else user or f"#{number}"
                handle = Handle(job, owner, number, abandon_after, listener, _wake=self._wake)
                if parent is not None:
                    parent.children.append(handle)
                self._runs[handle] = _Run(handle)
                self._line.add(handle)
                handles.append(handle)
            self._start()
        return handles

    def run(self, job: Job[T], progress: Progress | None = None, user: str | None = None) -> T:
        """Submit ``job`` and wait for its result (its error raised here; Cancelled if it was cancelled). On the
        engine's own thread (a benchmark section, which holds the model for its timings) the job runs to its end
        within the caller's step, alone: a later step would wait for the caller to finish."""
        if threading.current_thread() is self._thread:
            return self._run_alone(job, progress)
        handle = self.submit(job, user, listener=progress)
        try:
            return handle.result()
        finally:
            if not handle.finished:  # interrupted (Ctrl-C): nobody will read the result
                handle.cancel()

    def ahead(self, handle: Handle) -> int:
        """Runs ahead of a waiting run: those in progress plus the waiting runs before it (0 once it runs)."""
        with self._lock:
            order = self._line.order()
            if handle.status is not Status.WAITING or handle not in order:
                return 0
            return order.index(handle) + len(self._running)

    @property
    def waiting(self) -> int:
        """Runs in line, not admitted."""
        with self._lock:
            return len(self._line)

    # the loop

    def _start(self) -> None:
        """Start the engine's thread if none runs, else tell it there is work (hold ``_lock``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvviz-engine", daemon=True)
            self._thread.start()
        self._lock.notify_all()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                self._lock.wait_for(self._has_work, timeout=min(LOOK_SECONDS, self.idle_seconds))
                if not self._has_work() and not self._elsewhere:
                    if time.monotonic() - idle_since >= self.idle_seconds:
                        self._thread = None  # idle: this thread ends; the next work starts another
                        return
                    continue
                idle_since = time.monotonic()  # runs waiting elsewhere are looked at too (cancelled, abandoned)
                stopped = self._schedule()
            for run in stopped:
                self._stop(run)
            self._execute()
            self._forward()
            self._update()

    def _has_work(self) -> bool:
        """Runs to admit or advance, or a run waiting elsewhere whose client cancelled it (hold ``_lock``)."""
        return bool(self._line or self._running
                    or any(run.handle.cancel_requested for run in self._elsewhere.values()))

    def _schedule(self) -> list[_Run]:
        """Drop cancelled and abandoned runs, then admit waiting runs in turn; return the running runs to stop."""
        now = time.monotonic()
        for handle in self._line.remove_if(lambda h: self._gone(h, now)):
            self._end(self._runs[handle], self._stopped_as(handle))
        for run in [run for run in self._elsewhere.values() if not run.handle.finished and self._gone(run.handle,
                                                                                                      now)]:
            run.stop.set()  # its work ends when it next looks; the client is told now
            self._end(run, self._stopped_as(run.handle))
        stopped = [run for run in self._running if self._gone(run.handle, now)]
        self._running = [run for run in self._running if run not in stopped]
        busy = {run.handle.user for run in self._running}
        while (handle := self._line.admit(busy, self._admits)) is not None:
            run = self._runs[handle]
            handle.status, handle.started_at = Status.RUNNING, handle.started_at or now
            self._running.append(run)
            busy.add(handle.user)
        return stopped

    def _admits(self, handle: Handle) -> bool:
        return self.admission.admits([run.size for run in self._running], self._runs[handle].size)

    @staticmethod
    def _gone(handle: Handle, now: float) -> bool:
        return handle.cancel_requested or (handle.abandon_after is not None
                                           and now - handle.last_seen > handle.abandon_after)

    @staticmethod
    def _stopped_as(handle: Handle) -> Status:
        return Status.CANCELLED if handle.cancel_requested else Status.ABANDONED

    def _stop(self, run: _Run) -> None:
        """A running run cancelled or abandoned: its steps closed here (their ``finally`` blocks run), its decode
        groups out of the batch."""
        if run.steps is not None:
            try:
                run.steps.close()
            except Exception:  # noqa: BLE001, S110 - a run that fails while stopping is stopped all the same
                pass
        with self._lock:
            self._end(run, self._stopped_as(run.handle))

    def _execute(self) -> None:
        """Every admitted run that waits for nothing runs its steps up to what they ask next."""
        for run in [run for run in self._running if run.asked is None]:
            self._advance(run)

    def _advance(self, run: _Run) -> None:
        handle = run.handle
        try:
            if run.steps is None:
                run.steps = handle.job.start(handle.report)
            sent, thrown, run.send, run.throw = run.send, run.throw, None, None
            asked = run.steps.throw(thrown) if thrown is not None else run.steps.send(sent)
        except StopIteration as stop:
            with self._lock:
                self._end(run, Status.DONE, stop.value)
            return
        except BaseException as error:  # noqa: BLE001 - handed to the client, whatever it is
            with self._lock:
                self._end(run, Status.FAILED, error=error)
            return
        if isinstance(asked, Stage):
            handle.stage = asked
        elif isinstance(asked, SharedPrefill):
            handle.stage, run.asked, run.prefilled = Stage.PREFILL, asked, [None] * len(asked.prompts)
        elif isinstance(asked, Decode):
            handle.stage, run.asked = Stage.DECODE, asked
        elif isinstance(asked, Turn):
            with self._lock:
                run.size, handle.status = asked.size, Status.WAITING
                self._running.remove(run)
                self._line.again(handle)
        elif isinstance(asked, Elsewhere):
            with self._lock:
                handle.status = Status.ELSEWHERE
                self._running.remove(run)
                worker = threading.Thread(target=self._elsewhere_work, args=(run, asked), daemon=True,
                                          name=f"kvviz-elsewhere-{handle.number}")
                self._elsewhere[worker] = run
                worker.start()
        else:
            run.throw = TypeError(f"a job's step asked the engine for {asked!r}")

    def _elsewhere_work(self, run: _Run, asked: Elsewhere) -> None:
        """The work of a run that waits off the model; the run then waits in line for its next step."""
        try:
            run.send = asked.work(run.stop)
        except BaseException as error:  # noqa: BLE001 - raised in the run's steps
            run.throw = error
        with self._lock:
            del self._elsewhere[threading.current_thread()]
            if run.handle.finished:  # cancelled meanwhile
                return
            run.handle.status = Status.WAITING
            self._line.again(run.handle)
            self._start()

    def _forward(self) -> None:
        """One shared prefill for the prompts runs wait on, then one decode step for every admitted run's groups."""
        waiting = [(run, index) for run in self._running if isinstance(run.asked, SharedPrefill)
                   for index, outcome in enumerate(run.prefilled) if outcome is None]
        if waiting:
            first = waiting[0][0].asked
            alike = [(run, index) for run, index in waiting
                     if (run.asked.reuse_prefix, run.asked.prefix) == (first.reuse_prefix, first.prefix)]
            chosen = [alike[k] for k in prefill_share([len(run.asked.prompts[i]) for run, i in alike])]
            outcomes = self._prefill([run.asked.prompts[index] for run, index in chosen], first)
            for (run, index), outcome in zip(chosen, outcomes, strict=True):
                run.prefilled[index] = outcome
            self.prefills += 1
            self.shared_prefills += int(len({id(run) for run, _ in chosen}) > 1)
        decoding = [run for run in self._running if isinstance(run.asked, Decode)
                    and not all(group.finished for group in run.asked.groups)]
        if decoding:
            self._step([group for run in decoding for group in run.asked.groups if not group.finished])
            self.shared_forwards += int(len(decoding) > 1)

    def _update(self) -> None:
        """Runs whose prefill or decode is done are ready for their next steps (a failure raised in them)."""
        for run in self._running:
            if isinstance(run.asked, SharedPrefill) and all(outcome is not None for outcome in run.prefilled):
                run.throw = next((o for o in run.prefilled if isinstance(o, BaseException)), None)
                run.send = None if run.throw is not None else list(run.prefilled)
                run.asked = None
            elif isinstance(run.asked, Decode) and all(group.finished for group in run.asked.groups):
                run.throw = next((group.error for group in run.asked.groups if group.error is not None), None)
                run.asked = None

    def _prefill(self, prompts: list[list[int]], asked: SharedPrefill) -> list[PrefixPrefill | BaseException]:
        """The prompts (some of ``asked``'s) in one forward, starting from the job's own prefix blocks, else from the
        model's prefix cache when it asks to reuse it; a forward that fails as a whole (out of memory) fails each."""
        own = asked.prefix
        prefix = own if own is not None else self.prefix_cache if asked.reuse_prefix else None
        try:
            return prefill_together(self.model, self.device, prompts, prefix, store=own is None)
        except Exception as error:  # noqa: BLE001 - each run in the forward says so
            return [error] * len(prompts)

    def _step(self, groups: list[DecodeGroup]) -> None:
        """One decode step of ``groups`` in one forward, counted and timed; a forward that fails as a whole fails
        every group in it."""
        started = time.perf_counter()
        try:
            with small_work(self.device):  # a step of a few rows is thousands of small kernels
                step_groups(self.model, groups, self.device)
        except Exception as error:  # noqa: BLE001 - the forward itself failed (out of memory): its runs fail
            for group in groups:
                group.error = group.error or error
        finally:
            self.forwards += 1
            self.seconds += time.perf_counter() - started

    def _end(self, run: _Run, status: Status, value: Any = None, error: BaseException | None = None) -> None:
        """The run's outcome to its handle; the runs its work elsewhere submitted are cancelled with it (hold
        ``_lock``)."""
        if run in self._running:
            self._running.remove(run)
        self._runs.pop(run.handle, None)
        run.handle.finish(status, value, error)
        self.history.append(FinishedRun.of(run.handle))
        for child in run.children:
            if not child.finished:
                child.cancel()

    def _run_alone(self, job: Job[T], progress: Progress | None) -> T:
        """``job``'s steps driven to their end here, on the engine's thread inside another run's step, with nobody
        else's work: its prefills and decode steps alone, its turns and stages passed at once."""
        steps = job.start(progress or (lambda fraction, message: None))
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                asked = steps.throw(thrown) if thrown is not None else steps.send(sent)
            except StopIteration as stop:
                return stop.value
            sent, thrown = None, None
            if isinstance(asked, SharedPrefill):
                outcomes: list[PrefixPrefill | BaseException | None] = [None] * len(asked.prompts)
                while (pending := [i for i, outcome in enumerate(outcomes) if outcome is None]):
                    chosen = [pending[k] for k in prefill_share([len(asked.prompts[i]) for i in pending])]
                    for index, outcome in zip(chosen, self._prefill([asked.prompts[i] for i in chosen], asked),
                                              strict=True):
                        outcomes[index] = outcome
                thrown = next((o for o in outcomes if isinstance(o, BaseException)), None)
                sent = outcomes
            elif isinstance(asked, Decode):
                while unfinished := [group for group in asked.groups if not group.finished]:
                    self._step(unfinished)
                thrown = next((group.error for group in asked.groups if group.error is not None), None)
            elif isinstance(asked, Elsewhere):
                try:
                    sent = asked.work(threading.Event())
                except Exception as error:  # noqa: BLE001 - raised in the steps
                    thrown = error
