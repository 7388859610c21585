"""This server's most recent results in memory, shared by every session, with one fetch per result at a time."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import streamlit as st


@dataclass
class _Fetch:
    """One result being fetched: its lock, held by the session fetching it, and how many sessions want it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sessions: int = 0


class RecentResults:
    """This server's most recent results, shared by every session and returned as they are (not copied): a page
    re-rendering a result it already has costs nothing. Results are read, never changed, by the pages."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[str, object] = OrderedDict()
        self._fetching: dict[str, _Fetch] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> object | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: str, result: object) -> None:
        with self._lock:
            self._items[key] = result
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    @contextlib.contextmanager
    def computing(self, key: str) -> Iterator[None]:
        """Held while one session fetches ``key``: sessions asking for the same run wait for it and then find it
        here, instead of queueing the same run again."""
        with self._lock:
            fetch = self._fetching.setdefault(key, _Fetch())
            fetch.sessions += 1
        try:
            with fetch.lock:
                yield
        finally:
            with self._lock:
                fetch.sessions -= 1
                if not fetch.sessions:
                    del self._fetching[key]


@st.cache_resource(show_spinner=False)
def recent_results() -> RecentResults:
    """The server's one :class:`RecentResults`."""
    return RecentResults()
