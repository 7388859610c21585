"""A lock that serves its waiters in turn: the model's lock, shared by runs that decode together and the rest."""

from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """A reentrant lock handed out in the order it was asked for (``threading.RLock`` lets the thread that just
    released it take it straight back, which would keep a decoding batch ahead of every prefill)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._line: deque[object] = deque()

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._changed:
            if self._owner == me:
                self._depth += 1
                return True
            turn = object()
            self._line.append(turn)
            self._changed.wait_for(lambda: self._owner is None and self._line[0] is turn)
            self._line.popleft()
            self._owner, self._depth = me, 1
            return True

    @property
    def waiting(self) -> int:
        """How many threads are in line for the lock."""
        with self._changed:
            return len(self._line)

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        with self._changed:
            return self._owner == threading.get_ident()

    def release(self) -> None:
        with self._changed:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairLock this thread does not hold")
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._changed.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
