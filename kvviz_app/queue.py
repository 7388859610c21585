"""Runs through the server's shared queue and the result store, with a progress bar and a Cancel button.

A page names a request (:mod:`kvviz.runs`); it comes from this server's memory, else the result store, else it
runs in the shared queue (round-robin across users, up to ``RUNS_TOGETHER`` runs at once as the admission policy admits
them, whose comparisons decode in one batch) and is stored."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

import streamlit as st

from kvviz.cache.stats import AttentionStats
from kvviz.engine.results import Comparison
from kvviz.runs import AttentionRequest, CompareRequest, ResultStore, RunRequest
from kvviz.runtime.admission import RunSize
from kvviz.runtime.faults import describe_error
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.together import RUNS_TOGETHER
from kvviz_app.runqueue import DONE, RunQueue, Ticket

T = TypeVar("T")
PROGRESS_EVERY = 2.0  # seconds between progress bar updates


class RunFailed(Exception):
    """A queued run that did not finish: cancelled, abandoned or failed (the message says which and why)."""


@st.cache_resource(show_spinner=False)
def run_queue() -> RunQueue:
    """One queue per server: runs on the model start round-robin across users and decode together."""
    return RunQueue(abandon_after=30.0, format_error=describe_error, together=RUNS_TOGETHER)


_active: dict[str, Ticket] = {}  # browser session id -> its run in the queue (for the Cancel button)


def _session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    context = get_script_run_ctx()
    return context.session_id if context is not None else "local"


def through_queue(user: str, job: Callable[[Callable[[float, str], None]], T],
                  progress: Callable[[float, str], None], size: RunSize | None = None) -> T:
    """Run ``job`` in the shared queue while reporting the place in line, then the run's own progress; ``size`` is
    what the queue's admission policy weighs.

    Polling keeps the run alive; a page that stops polling (closed tab, rerun, Cancel) gives its slot back.
    """
    queue = run_queue()
    ticket = queue.submit(user, job, size)
    _active[user] = ticket
    shown, shown_at = None, 0.0
    try:
        while not ticket.done.wait(0.2):
            ticket.touch()
            state = (round(ticket.fraction, 2), queue_message(queue.ahead(ticket), ticket))
            # each update is a message to the browser and a repaint there, which on a small server shared with
            # the browser took 15% off the model's speed at five a second: changes only, every PROGRESS_EVERY
            if state != shown and time.monotonic() - shown_at >= PROGRESS_EVERY:
                progress(*state)
                shown, shown_at = state, time.monotonic()
    finally:
        if not ticket.finished:
            ticket.cancel()  # interrupted (rerun or closed page): nobody will read this result
        if _active.get(user) is ticket:
            del _active[user]
    if ticket.status != DONE:
        raise RunFailed(ticket.error or ticket.status)
    return ticket.result


def queue_message(ahead: int, ticket: Ticket) -> str:
    """What the progress bar says: how many runs are ahead in line, or the run's own progress."""
    if ahead:
        return f"Queued behind {ahead} other run{'s' if ahead > 1 else ''}…"
    return "Starting…" if ticket.status == "queued" else ticket.message


def _cancel(user: str, request_key: str | None) -> None:
    ticket = _active.get(user)
    if ticket is not None:
        ticket.cancel()
    if request_key:
        st.session_state.pop(request_key, None)
    st.session_state["kvviz_notice"] = "Run cancelled."


def queued(compute: Callable[[str, Callable[[float, str], None]], T], start_text: str,
           request_key: str | None = None) -> T:
    """Show a progress bar and a Cancel button around a queued computation; stop the page on failure.

    ``compute(user, progress)`` reports through ``progress`` (the place in line, then the run's own progress).
    """
    notice = st.session_state.pop("kvviz_notice", None)
    if notice:
        st.info(notice)
    user = _session_id()
    bar = st.progress(0.0, text=start_text)
    cancel = st.empty()
    cancel.button("Cancel run", key=f"cancel_{request_key or start_text}", on_click=_cancel,
                  args=(user, request_key))
    try:
        result = compute(user, lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m))
    except RunFailed as error:
        bar.empty()
        cancel.empty()
        st.error(f"The run did not finish: {error}")
        st.stop()
    bar.empty()
    cancel.empty()
    return result


@st.cache_resource(show_spinner=False)
def result_store() -> ResultStore:
    """Results on disk, shared with the class warm-up (``make warm``) and later server processes."""
    return ResultStore.default()


class RecentResults:
    """This server's most recent results, shared by every session and returned as they are (not copied): a page
    re-rendering a result it already has costs nothing. Results are read, never changed, by the pages."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[str, object] = OrderedDict()
        self._computing: dict[str, list] = {}  # key -> [lock, sessions holding or waiting for it]
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
            entry = self._computing.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._computing[key]


@st.cache_resource(show_spinner=False)
def recent_results() -> RecentResults:
    return RecentResults()


def stored_or_run(loaded: LoadedModel, request: RunRequest, user: str,
                  progress: Callable[[float, str], None]) -> object:
    """A request's result from the result store, else run through the shared queue (and stored)."""
    store = result_store()
    found = store.load(loaded, request)
    if found is None:
        # looked up again when its turn comes: another user's identical run (a lesson step) may be stored by then
        found = through_queue(user, lambda report: store.fetch(loaded, request, report), progress,
                              request.run_size(loaded))
    return found


def run_request(loaded: LoadedModel, request: RunRequest, start_text: str, request_key: str | None = None) -> object:
    """A request's result: from this server's memory at once, else from the store or a run in the shared queue,
    with a progress bar and a Cancel button."""
    key = f"{loaded.name}:{loaded.device}:{request!r}"
    memory = recent_results()
    found = memory.get(key)
    if found is None:
        with memory.computing(key):
            found = memory.get(key)  # another session may have fetched it while this one waited
            if found is None:
                found = queued(lambda user, progress: stored_or_run(loaded, request, user, progress), start_text,
                               request_key)
                memory.put(key, found)
    return found


def run_pressed(loaded: LoadedModel, key: str, waiting: str, start_text: str) -> tuple[RunRequest, object]:
    """The request a page's run button stored in session state under ``key``, and its result (:func:`run_request`).
    Until the button is pressed the page shows ``waiting`` and stops; a request the engine refuses (ValueError)
    shows its one-line message and stops."""
    request = st.session_state.get(key)
    if request is None:
        st.info(waiting)
        st.stop()
    try:
        return request, run_request(loaded, request, start_text, request_key=key)
    except ValueError as error:
        st.error(str(error))
        st.stop()


def run_comparison(loaded: LoadedModel, prompt_ids: list[int], specs: list[str], max_new_tokens: int,
                   request_key: str | None = None) -> Comparison:
    """A comparison through the shared queue with a live progress bar (instant when the same inputs ran before)."""
    return run_request(loaded, CompareRequest(tuple(prompt_ids), tuple(specs), max_new_tokens), "Starting…",
                       request_key)


def attention_stats(loaded: LoadedModel, prompt_ids: list[int], layer: int, sink_tokens: int,
                    every_layer: bool = False) -> AttentionStats:
    """Prefill statistics through the shared queue with a progress bar (instant when cached)."""
    return run_request(loaded, AttentionRequest(tuple(prompt_ids), layer, sink_tokens, every_layer),
                       "Summing attention over every layer…" if every_layer else "Running the prompt…")
