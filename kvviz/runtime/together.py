"""Runs of different users decoding together: every run's rows in one forward per step (continuous batching).

A run (one thread per run, as the app's queue runs them) prefills and forks on its own, holding the model's lock, then
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
"""

from __future__ import annotations

import threading
import weakref

import torch

from kvviz.runtime.batch import DecodeGroup, step_groups
from kvviz.runtime.turns import FairLock

RUNS_TOGETHER = 8  # runs a server admits into one running batch at once; each holds its caches while it decodes
# (four 2K-token comparisons of six configurations on SmolLM2 held 3 GB more together than one at a time, measured
# on the CPU); the app's queue and the bench's classroom use it


class SharedDecoder:
    """One model's running batch: :meth:`decode` from any number of threads; their groups share each forward."""

    def __init__(self, model: torch.nn.Module, device: str, lock: FairLock):
        self.model, self.device, self.lock = model, device, lock
        self._changed = threading.Condition()
        self._groups: list[DecodeGroup] = []
        self._stepping = False
        self.forwards = 0  # forwards run so far, and how many of them fed more than one run
        self.shared_forwards = 0

    def decode(self, group: DecodeGroup) -> None:
        """Decode ``group`` in the running batch; return when it is finished (its ``error`` says whether it failed).

        A caller already holding the model's lock (a study running several comparisons under it) decodes its group
        alone: the batch's turn could not take the lock from it."""
        if self.lock.held():
            while not group.finished:
                step_groups(self.model, [group], self.device)
            return
        with self._changed:
            self._groups.append(group)
        while True:
            with self._changed:
                self._changed.wait_for(lambda: group.finished or not self._stepping)
                if group.finished:
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
                step_groups(self.model, groups, self.device)
            except Exception as error:  # noqa: BLE001 - the forward itself failed (out of memory): its runs fail
                for group in groups:
                    group.error = group.error or error
        self.forwards += 1
        self.shared_forwards += len(groups) > 1
        with self._changed:
            self._groups = [group for group in self._groups if not group.finished]


_decoders: dict[int, SharedDecoder] = {}
_decoders_lock = threading.Lock()


def shared_decoder(loaded) -> SharedDecoder:
    """The running batch of ``loaded`` (a :class:`~kvviz.runtime.models.LoadedModel`): one per model, device and
    dtype, as each loaded model is one of those; created on first use, dropped with the model."""
    with _decoders_lock:
        decoder = _decoders.get(id(loaded))
        if decoder is None:
            decoder = _decoders[id(loaded)] = SharedDecoder(loaded.model, loaded.device, loaded.lock)
            weakref.finalize(loaded, _decoders.pop, id(loaded), None)
        return decoder


def shared_forwards() -> int:
    """Forwards that fed more than one run, over every model's running batch in this process (the load test reads
    it to see that a class's runs really decoded together)."""
    with _decoders_lock:
        return sum(decoder.shared_forwards for decoder in _decoders.values())
