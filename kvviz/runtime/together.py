"""Runs of different users sharing forwards: decode steps in the engine's running batch, prompts in one prefill.

A run (one of the scheduler's, :mod:`kvviz.runtime.scheduler`) hands its prefill and its fork to the model's engine
(:mod:`kvviz.runtime.engine`), then its rows, a :class:`~kvviz.runtime.batch.DecodeGroup`, to the engine's running
batch, and waits: each step the engine feeds every group admitted so far in one forward; between two steps it runs the
work that arrived meanwhile (another run's prefill, an attention capture), in arrival order, so nobody waits behind
the batch and the batch waits behind one turn of each.

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
from dataclasses import dataclass

import torch

from kvviz.runtime.engine import SHARED_PREFILLS, Engine
from kvviz.runtime.prefill import PrefixPrefill, prefill_together
from kvviz.runtime.prefix import PrefixCache

RUNS_TOGETHER = 8  # runs a server admits into one running batch at once; each holds its caches while it decodes
# (eight 2K-token comparisons of six configurations on SmolLM2 decoding together held 17.7 GB resident, measured on
# the CPU); the admission policy (kvviz.runtime.admission) starts at most this many


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

    A run queues its prompt and hands the engine its prefill; whichever of those the engine runs first prefills every
    prompt queued by then (up to :data:`PREFILL_TOKENS` positions, the longest prompts left for the next turn), and
    the others find theirs done. Only prompts nobody listens to are shared (no capture for the page's statistics
    or a method's selection): a listener belongs to its own prompt's forward. Each
    :class:`~kvviz.runtime.models.LoadedModel` builds its own, over its engine and prefix cache."""

    def __init__(self, model: torch.nn.Module, device: str, engine: Engine, prefix_cache: PrefixCache):
        self.model, self.device, self.engine, self.prefix_cache = model, device, engine, prefix_cache
        self._pending: list[PrefillJob] = []
        self._pending_lock = threading.Lock()
        self.forwards = 0  # prefill forwards run so far, and how many of them fed more than one prompt
        self.shared_forwards = 0

    def prefill(self, token_ids: list[int], reuse_prefix: bool) -> PrefixPrefill:
        """``token_ids`` prefilled (with other runs' prompts when they are waiting too); raises its row's error."""
        job = PrefillJob(list(token_ids), reuse_prefix)
        with self._pending_lock:
            self._pending.append(job)

        def mine_unless_done() -> None:  # an earlier turn may have prefilled it with its own
            if job.outcome is None:
                self._run(self._take(job))

        self.engine.call(mine_unless_done)
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

