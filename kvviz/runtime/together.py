"""Runs of different users decoding together: every run's rows in one forward per step (continuous batching).

A run (one thread per run, as the app's queue runs them) prefills, then forks on its own holding the model's lock, then
hands its rows, a :class:`~kvviz.runtime.batch.DecodeGroup`, to the model's :class:`SharedDecoder` and waits. The groups
waiting form one running batch: each step, whichever waiting thread holds the turn takes the model's lock, steps
every group admitted so far in one forward (:func:`kvviz.runtime.batch.step_groups`) and passes the turn on. A group
joins at the first step after it arrives and leaves after the step it finishes. The model's lock is handed out in
arrival order (:class:`FairLock`), so between two steps the runs that asked for it meanwhile (another run's prefill,
an attention capture) go first: nobody waits behind the batch, and the batch waits behind one turn of each.

Each row does exactly what it does alone (its own cache, sampler and step count), so every run's result equals the
same run decoded alone, token for token. A group whose step fails (its progress report raised because its user
cancelled) leaves with that error at that step; a row that fails leaves its run's result with that row's error
only; a forward that fails as a whole (out of memory) fails the runs in it.

Prefills are shared the same way (:class:`SharedPrefill`): prompts queued while the model is busy go through one
forward, each row over its own keys, padded at its end. A short prompt's forward on a CPU is bound by reading the
weights: eight 30-token prompts cost what four do alone (measured on the 2-core CPU). A prompt whose attention is
recorded prefills alone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvviz.runtime.batch import DecodeGroup, step_groups
from kvviz.runtime.prefill import PrefixPrefill, prefill_together
from kvviz.runtime.prefix import PrefixCache
from kvviz.runtime.turns import FairLock

RUNS_TOGETHER = 8  # runs a server admits into one running batch at once; each holds its caches while it decodes
# (eight 2K-token comparisons of six configurations on SmolLM2 decoding together held 17.7 GB resident, measured on
# the CPU); the admission policy (kvviz.runtime.admission) starts at most this many


@dataclass
class SharedCount:
    """Forwards that fed more than one run, over every model in this process (the load test reads it to see that a
    class's runs really went through merged forwards)."""

    value: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self) -> None:
        with self._lock:
            self.value += 1


SHARED_DECODES = SharedCount()
SHARED_PREFILLS = SharedCount()


class SharedDecoder:
    """One model's running batch (each :class:`~kvviz.runtime.models.LoadedModel` builds its own): :meth:`decode`
    from any number of threads; their groups share each forward."""

    def __init__(self, model: torch.nn.Module, device: str, lock: FairLock):
        self.model, self.device, self.lock = model, device, lock
        self._changed = threading.Condition()
        self._groups: list[DecodeGroup] = []
        self._stepping = False
        self.forwards = 0  # forwards run so far, and how many of them fed more than one run
        self.shared_forwards = 0
        self.seconds = 0.0  # wall seconds spent in those steps (the bench splits a class's time with it)

    def decode(self, *groups: DecodeGroup) -> None:
        """Decode ``groups`` in the running batch; return when all are finished (each one's ``error`` says whether
        it failed). A study passes the groups of several prompts at once, so they share every forward.

        A caller already holding the model's lock (a study running several comparisons under it) decodes its groups
        alone: the batch's turn could not take the lock from it."""
        def finished() -> bool:
            return all(group.finished for group in groups)

        if self.lock.held():
            while not finished():
                self._timed_step([group for group in groups if not group.finished])
            return
        with self._changed:
            self._groups.extend(groups)
        while True:
            with self._changed:
                self._changed.wait_for(lambda: finished() or not self._stepping)
                if finished():
                    return
                self._stepping = True
            try:
                self._step()
            finally:
                with self._changed:
                    self._stepping = False
                    self._changed.notify_all()

    def _step(self) -> None:
        """One forward for every group admitted so far; finished groups leave the batch."""
        with self.lock:  # the groups that arrived while this turn waited for the model join this step
            with self._changed:
                groups = list(self._groups)
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

    def _timed_step(self, groups: list[DecodeGroup]) -> None:
        """One decode step of ``groups``, counted and timed (a failing forward included)."""
        started = time.perf_counter()
        try:
            step_groups(self.model, groups, self.device)
        finally:
            self.forwards += 1
            self.seconds += time.perf_counter() - started


PREFILL_TOKENS = 512  # most prompt positions (padding included) one shared prefill feeds: on the CPU a forward of
# 30 tokens costs 87 ms and one of eight 30-token prompts 384 ms, but past a few hundred tokens a forward is bound by
# its arithmetic and batching gains nothing (a 512-token forward 811 ms, measured on the 2-core CPU)


@dataclass
class PrefillJob:
    """One run's prompt waiting for a shared prefill, and what became of it."""

    token_ids: list[int]
    reuse_prefix: bool
    outcome: PrefixPrefill | BaseException | None = None


class SharedPrefill:
    """The prompts of runs that arrive while the model is busy, prefilled together in one forward.

    A run queues its prompt and waits its turn for the model's lock; whoever gets the lock first prefills every
    prompt queued by then (up to :data:`PREFILL_TOKENS` positions, the longest prompts left for the next turn), and
    the others find theirs done. Only prompts nobody listens to are shared (no capture for the page's statistics
    or a method's selection): a listener belongs to its own prompt's forward. Each
    :class:`~kvviz.runtime.models.LoadedModel` builds its own, over its lock and prefix cache."""

    def __init__(self, model: torch.nn.Module, device: str, lock: FairLock, prefix_cache: PrefixCache):
        self.model, self.device, self.lock, self.prefix_cache = model, device, lock, prefix_cache
        self._pending: list[PrefillJob] = []
        self._pending_lock = threading.Lock()
        self.forwards = 0  # prefill forwards run so far, and how many of them fed more than one prompt
        self.shared_forwards = 0

    def prefill(self, token_ids: list[int], reuse_prefix: bool) -> PrefixPrefill:
        """``token_ids`` prefilled (with other runs' prompts when they are waiting too); raises its row's error."""
        job = PrefillJob(list(token_ids), reuse_prefix)
        with self._pending_lock:
            self._pending.append(job)
        with self.lock:
            if job.outcome is None:
                self._run(self._take(job))
        if isinstance(job.outcome, BaseException):
            raise job.outcome
        return job.outcome

    def _take(self, job: PrefillJob) -> list[PrefillJob]:
        """``job`` and the waiting prompts that fit beside it, shortest first; the others wait for their turn."""
        with self._pending_lock:
            taken = [job]
            for other in sorted(self._pending, key=lambda o: len(o.token_ids)):  # the longest so far: job or other
                longest = max(len(job.token_ids), len(other.token_ids))
                if other is not job and other.reuse_prefix == job.reuse_prefix and (
                        longest * (len(taken) + 1) <= PREFILL_TOKENS):
                    taken.append(other)
            self._pending = [other for other in self._pending if other not in taken]
            return taken

    def _run(self, jobs: list[PrefillJob]) -> None:
        prefix = self.prefix_cache if jobs[0].reuse_prefix else None
        try:
            outcomes = prefill_together(self.model, self.device, [job.token_ids for job in jobs], prefix)
        except Exception as error:  # noqa: BLE001 - the forward failed as a whole (out of memory): each run says so
            outcomes = [error] * len(jobs)
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.outcome = outcome
        self.forwards += 1
        if len(jobs) > 1:
            self.shared_forwards += 1
            SHARED_PREFILLS.add()


def shared_forwards() -> int:
    """Forwards that fed more than one run, over every model's running batch in this process."""
    return SHARED_DECODES.value


def shared_prefills() -> int:
    """Prefill forwards that fed more than one run's prompt, over every model in this process."""
    return SHARED_PREFILLS.value
