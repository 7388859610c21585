"""The engine's line of runs waiting for the model, fair across users.

Each user's runs wait first in, first out; users take turns, one run each per round, in the order they first
queued. A student who queues five comparisons does not starve the others: nobody waits behind more than one run of
each other user. A run that gives the model back between two of its steps (a study's item, a sweep's wave) goes to
the front of its user's own line, and its user to the back of the round, so a long study takes turns with
everyone else's runs instead of holding the model for its whole length.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from kvviz.runtime.jobs import Handle


class WaitingLine:
    """Runs not admitted yet, one line per user, served round-robin. Not thread-safe: the engine holds its own
    lock around every call."""

    def __init__(self) -> None:
        self._per_user: OrderedDict[str, deque[Handle]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(line) for line in self._per_user.values())

    def __iter__(self) -> Iterator[Handle]:
        return iter(self.order())

    def add(self, handle: Handle) -> None:
        """A newly submitted run: at the back of its user's line."""
        self._per_user.setdefault(handle.user, deque()).append(handle)

    def again(self, handle: Handle) -> None:
        """A run that gave the model back between two steps: first of its user's line, its user last in the
        round."""
        line = self._per_user.pop(handle.user, deque())
        line.appendleft(handle)
        self._per_user[handle.user] = line

    def order(self) -> list[Handle]:
        """The order the waiting runs would start in: one per user per round, users in the round's order."""
        rounds = itertools.zip_longest(*(list(line) for line in self._per_user.values()))
        return [handle for round_ in rounds for handle in round_ if handle is not None]

    def remove_if(self, gone: Callable[[Handle], bool]) -> list[Handle]:
        """Take out (and return) every waiting run for which ``gone`` says so (cancelled, abandoned)."""
        removed = []
        for user in list(self._per_user):
            kept = deque(handle for handle in self._per_user[user] if not gone(handle))
            removed += [handle for handle in self._per_user[user] if handle not in kept]
            if kept:
                self._per_user[user] = kept
            else:
                del self._per_user[user]
        return removed

    def admit(self, busy: set[str], admits: Callable[[Handle], bool]) -> Handle | None:
        """The next run to start, taken out of the line, or None: the first user in the round with no run in
        progress (not in ``busy``) whose first run ``admits`` lets in starts it and goes to the back of the round.
        When that run is not let in, nothing starts (nobody overtakes it)."""
        user = next((user for user in self._per_user if user not in busy), None)
        if user is None or not admits(self._per_user[user][0]):
            return None
        line = self._per_user.pop(user)
        handle = line.popleft()
        if line:
            self._per_user[user] = line
        return handle
