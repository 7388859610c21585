"""Runs through the server's shared queue and the result store, with a progress bar and a Cancel button.

A page names a request (:mod:`kvviz.runs`); it comes from this server's memory, else the result store, else it
runs in the shared queue (one run at a time, round-robin across users) and is stored."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from kvviz.core.capture import AttentionStats
from kvviz.core.faults import describe_error
from kvviz.core.models import LoadedModel
from kvviz.results import Comparison
from kvviz.runs import AttentionRequest, CompareRequest, ResultStore, RunRequest
from kvviz_app.runqueue import DONE, RunQueue, Ticket

T = TypeVar("T")


def unrecorded(callback: Callable[..., None]) -> Callable[..., None]:
    """Run Streamlit calls made from inside a cached computation without recording them for cache replay.

    Progress bars live outside the cached function; st.cache_data would otherwise record their updates and fail
    to replay them on a cache hit. The calls run in a copy of the context with Streamlit's ``in_cached_function``
    flag unset.
    """
    from streamlit.runtime.scriptrunner_utils.script_run_context import in_cached_function

    def outside_cache(*args: object) -> None:
        in_cached_function.set(False)
        callback(*args)

    def run(*args: object) -> None:
        contextvars.copy_context().run(outside_cache, *args)

    return run


class RunFailed(Exception):
    """A queued run that did not finish: cancelled, abandoned or failed (the message says which and why)."""


@st.cache_resource(show_spinner=False)
def run_queue() -> RunQueue:
    """One queue per server: runs on the model go one at a time, round-robin across users."""
    return RunQueue(abandon_after=30.0, format_error=describe_error)


_active: dict[str, Ticket] = {}  # browser session id -> its run in the queue (for the Cancel button)


def _session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    context = get_script_run_ctx()
    return context.session_id if context is not None else "local"


def through_queue(user: str, job: Callable[[Callable[[float, str], None]], T],
                  progress: Callable[[float, str], None]) -> T:
    """Run ``job`` in the shared queue while reporting the place in line, then the run's own progress.

    Polling keeps the run alive; a page that stops polling (closed tab, rerun, Cancel) gives its slot back.
    """
    queue = run_queue()
    ticket = queue.submit(user, job)
    _active[user] = ticket
    try:
        while not ticket.done.wait(0.2):
            ticket.touch()
            progress(ticket.fraction, queue_message(queue.ahead(ticket), ticket))
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
    """Show a progress bar and a Cancel button around a cached, queued computation; stop the page on failure.

    ``compute(user, progress)`` is a st.cache_data function that calls :func:`through_queue` on a miss.
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
        result = compute(user, unrecorded(lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m)))
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


@st.cache_data(show_spinner=False, max_entries=64)
def cached_run(key: str, _loaded: LoadedModel, _request: RunRequest, _user: str,
               _progress: Callable[[float, str], None]) -> object:
    """A request's result: from this server's memory, else from the result store, else run through the shared
    queue and stored. ``key`` (the request with its model) is the memory cache's key."""
    store = result_store()
    found = store.load(_loaded, _request)
    if found is not None:
        return found
    # looked up again when its turn comes: another user's identical run (a lesson step) may have stored it by then
    return through_queue(_user, lambda report: store.fetch(_loaded, _request, report), _progress)


def run_request(loaded: LoadedModel, request: RunRequest, start_text: str, request_key: str | None = None) -> object:
    """A request through the store and the shared queue, with a progress bar and a Cancel button."""
    return queued(lambda user, progress: cached_run(f"{loaded.name}:{request!r}", loaded, request, user, progress),
                  start_text, request_key)


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
