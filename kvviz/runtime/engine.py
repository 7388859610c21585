"""One engine per loaded model: a long-lived thread that runs every forward on it, and the running batch it steps.

Runs (a page's comparison, a lesson step, a study, the CLI, the bench) are clients: they hand the engine what needs
the model, :meth:`Engine.call` for a piece of model work (a prefill, a fork, a whole study) and :meth:`Engine.decode`
for their rows' decode steps, and wait for it. The engine's loop takes, at each step boundary, the work that arrived
meanwhile in arrival order, then steps every decode group admitted so far in one forward
(:func:`kvviz.runtime.batch.step_groups`): a group joins at the first step after it arrives and leaves after the
step it finishes. Which runs are in progress at all is the scheduler's choice (:mod:`kvviz.runtime.scheduler`, by
:mod:`kvviz.runtime.admission`); the engine only serves what they hand it.

Why one thread, not one per run and not a process: torch's CPU kernels run on OpenMP (GNU libgomp in the PyPI
wheels), which gives every thread that starts parallel work a pool of helper threads of its own, kept until that
thread exits; once the pools of all live threads hold more threads than the machine has CPUs, helpers stop spinning
between kernels and each kernel waits for its helpers to wake. Model work on one long-lived thread keeps one pool,
for the whole server, so it computes on every core run after run; and glibc's malloc, which gives each allocating
thread an arena of its own and keeps what a run freed there, finds the next run's tensors in the same arena. Both
used to need a new thread per run, an arena cap in the server's environment and protobuf in pure Python
(docs/architecture.md, docs/performance.md). A process of its own was measured against this thread (the bench's
``engine_process`` section): it ran a comparison no faster, took seconds to start and a second copy of torch and the
model in memory, and would carry every result, progress report and cancellation over a pipe; the engine's work holds
the interpreter lock only between kernels, so a thread leaves the server's other threads free.

The engine's turn is the model's :class:`~kvviz.runtime.turns.FairLock`: the loop holds it for each turn, so a caller
that takes ``loaded.lock`` itself (a test, a notebook) has the model to itself for its block and runs its work
inline, as :meth:`call` and :meth:`decode` do on the engine's own thread. The thread exits after
:data:`IDLE_SECONDS` without work (a model dropped from a server's cache is then freed) and starts again on demand.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from kvviz.runtime.batch import DecodeGroup, step_groups
from kvviz.runtime.turns import FairLock

T = TypeVar("T")
IDLE_SECONDS = 60.0  # an engine thread without work for this long exits (a new one starts with the next work)


class _Call(Generic[T]):
    """One piece of model work handed to the engine, and its outcome."""

    def __init__(self, work: Callable[[], T]):
        self.work = work
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is (a cancelled run's too)
            self.error = error
        finally:
            self.done.set()


class Engine:
    """A loaded model's engine (each :class:`~kvviz.runtime.models.LoadedModel` builds one): :meth:`call` and
    :meth:`decode` from any thread; the forwards run on the engine's thread."""

    def __init__(self, model: torch.nn.Module, device: str, lock: FairLock | None = None,
                 idle_seconds: float = IDLE_SECONDS):
        self.model, self.device, self.idle_seconds = model, device, idle_seconds
        self.lock = lock or FairLock()
        self._changed = threading.Condition()
        self._calls: deque[_Call] = deque()
        self._groups: list[DecodeGroup] = []
        self._thread: threading.Thread | None = None
        self.forwards = 0  # decode forwards run so far, and how many of them fed more than one run
        self.shared_forwards = 0
        self.seconds = 0.0  # wall seconds spent in those steps (the bench splits a class's time with it)
        self.threads_started = 0  # engine threads started so far (one per busy spell; tests read it)

    def inline(self) -> bool:
        """Whether work from the calling thread runs where it is: on the engine's thread, or under the model's lock
        taken by the caller (which then has the model to itself)."""
        return threading.current_thread() is self._thread or self.lock.held()

    @property
    def waiting(self) -> int:
        """Pieces of work handed to the engine and not yet started."""
        with self._changed:
            return len(self._calls)

    def call(self, work: Callable[[], T]) -> T:
        """``work()`` on the engine's thread, at the next step boundary, after the work that arrived before it;
        its result, or its exception raised here."""
        if self.inline():
            return work()
        call = _Call(work)
        with self._changed:
            self._calls.append(call)
            self._wake()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def decode(self, *groups: DecodeGroup) -> None:
        """Decode ``groups`` in the running batch; return when all are finished (each one's ``error`` says whether
        it failed). A study passes the groups of several prompts at once, so they share every forward; inline (a
        study on the engine's thread, a caller holding the lock) they decode alone."""
        def finished() -> bool:
            return all(group.finished for group in groups)

        if self.inline():
            while not finished():
                self._timed_step([group for group in groups if not group.finished])
            return
        with self._changed:
            self._groups.extend(groups)
            self._wake()
            self._changed.wait_for(finished)

    def _wake(self) -> None:
        """Start the engine's thread if none runs, else tell it there is work (hold ``_changed``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvviz-engine", daemon=True)
            self.threads_started += 1
            self._thread.start()
        self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self._changed:
                if not self._changed.wait_for(lambda: self._calls or self._groups, timeout=self.idle_seconds):
                    self._thread = None  # idle: this thread ends; the next work starts another
                    return
            with self.lock:
                with self._changed:  # what arrived while this turn waited for the model
                    calls, self._calls = list(self._calls), deque()
                    groups = list(self._groups)
                for call in calls:
                    call.run()
                if groups:
                    self._step(groups)

    def _step(self, groups: list[DecodeGroup]) -> None:
        """One forward for ``groups``; finished groups leave the batch and their callers are told."""
        try:
            self._timed_step(groups)
        except Exception as error:  # noqa: BLE001 - the forward itself failed (out of memory): its runs fail
            for group in groups:
                group.error = group.error or error
        if len(groups) > 1:
            self.shared_forwards += 1
            SHARED_DECODES.add()
        with self._changed:
            self._groups = [group for group in self._groups if not group.finished]
            self._changed.notify_all()

    def _timed_step(self, groups: list[DecodeGroup]) -> None:
        """One decode step of ``groups``, counted and timed (a failing forward included)."""
        started = time.perf_counter()
        try:
            step_groups(self.model, groups, self.device)
        finally:
            self.forwards += 1
            self.seconds += time.perf_counter() - started


def on_engine(study: Callable[..., T]) -> Callable[..., T]:
    """``study(loaded, ...)`` run as one piece of its model's engine work, whoever calls it (a page's request, the
    CLI, the bench, a notebook): the engine has the model to itself for the whole study, and every forward runs on
    the engine's thread, so a caller never starts a second OpenMP pool of its own beside the engine's."""

    @functools.wraps(study)
    def served(loaded, *args, **kwargs) -> T:
        return loaded.engine.call(lambda: study(loaded, *args, **kwargs))

    return served


class SharedCount:
    """Forwards that fed more than one run, over every model in this process (the load test reads it to see that a
    class's runs really went through merged forwards)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


SHARED_DECODES = SharedCount()
SHARED_PREFILLS = SharedCount()


def shared_forwards() -> int:
    """Forwards that fed more than one run, over every model's running batch in this process."""
    return SHARED_DECODES.value


def shared_prefills() -> int:
    """Prefill forwards that fed more than one run's prompt, over every model in this process."""
    return SHARED_PREFILLS.value
