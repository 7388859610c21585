"""A run on the model's engine (:mod:`kvviz.runtime.engine`), shown on the page as a progress bar with a Cancel
button: first the place in line, then the run's own progress."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from kvviz.runtime.engine import Engine
from kvviz.runtime.faults import describe_error
from kvviz.runtime.jobs import Handle, Job, Status
from kvviz.runtime.progress import Progress

T = TypeVar("T")
PROGRESS_EVERY = 2.0  # seconds between progress bar updates
POLL_SECONDS = 0.2  # how often the page looks at its run (and tells the engine it is still there)
ABANDON_AFTER = 30.0  # seconds without a look before the engine drops a page's run (the browser went away)
SESSION_KEY = "kvviz_session_id"  # session state: this browser session's id, its name in the engine's line
HANDLE_KEY = "kvviz_handle"  # session state: this session's run while the page waits for it (Cancel finds it)
NOTICE_KEY = "kvviz_notice"  # session state: a message for the next rerun ("Run cancelled.")


class RunFailed(Exception):
    """A run that did not finish: cancelled, abandoned or failed (the message says which and why)."""


def session_id() -> str:
    """This browser session's name in the engine's line (each tab its own), made once and kept in its session
    state."""
    return st.session_state.setdefault(SESSION_KEY, uuid.uuid4().hex)


def queue_message(ahead: int, handle: Handle) -> str:
    """What the progress bar says: how many runs are ahead in line, or the run's own progress."""
    if ahead:
        return f"Queued behind {ahead} other run{'s' if ahead > 1 else ''}…"
    return "Starting…" if handle.status is Status.WAITING else handle.message


def follow(engine: Engine, job: Job[T], user: str, progress: Progress) -> T:
    """Submit ``job`` to the model's engine as ``user`` and follow its handle: the place in line, then the run's own
    progress, reported through ``progress`` on this (the page's) thread.

    Following keeps the run alive; a page that stops (closed tab, rerun, Cancel) gives its place back. While it
    follows, the handle sits in the session's state, where the Cancel button's callback finds it.
    """
    handle = engine.submit(job, user, abandon_after=ABANDON_AFTER)
    st.session_state[HANDLE_KEY] = handle
    shown, shown_at = None, 0.0
    try:
        while not handle.wait(POLL_SECONDS):
            handle.touch()
            state = (round(handle.fraction, 2), queue_message(engine.ahead(handle), handle))
            # each update is a message to the browser and a repaint there, which on a small server shared with
            # the browser took 15% off the model's speed at five a second: changes only, every PROGRESS_EVERY
            if state != shown and time.monotonic() - shown_at >= PROGRESS_EVERY:
                progress(*state)
                shown, shown_at = state, time.monotonic()
    finally:
        if not handle.finished:
            handle.cancel()  # interrupted (rerun or closed page): nobody will read this result
        if st.session_state.get(HANDLE_KEY) is handle:
            del st.session_state[HANDLE_KEY]
    if handle.status is Status.FAILED:
        raise RunFailed(describe_error(handle.error))
    if handle.status is not Status.DONE:
        raise RunFailed(handle.status.value)
    return handle.result()


def cancel_run(request_key: str | None) -> None:
    """The Cancel button's callback (it runs before the rerun it causes): stop this session's run and forget the
    request that asked for it, so the page does not ask again."""
    handle = st.session_state.get(HANDLE_KEY)
    if handle is not None:
        handle.cancel()
    if request_key:
        st.session_state.pop(request_key, None)
    st.session_state[NOTICE_KEY] = "Run cancelled."


def show_notice() -> None:
    """The message the last rerun left for this one ("Run cancelled."), once."""
    notice = st.session_state.pop(NOTICE_KEY, None)
    if notice:
        st.info(notice)


def with_progress(compute: Callable[[str, Progress], T], start_text: str, request_key: str | None = None) -> T:
    """Show a progress bar and a Cancel button around a run on the engine; stop the page on failure.

    ``compute(user, progress)`` reports through ``progress`` (the place in line, then the run's own progress).
    Cancel also forgets the request under ``request_key`` in the session's state.
    """
    show_notice()
    bar = st.progress(0.0, text=start_text)
    cancel = st.empty()
    cancel.button("Cancel run", key=f"cancel_{request_key or start_text}", on_click=cancel_run, args=(request_key,))
    try:
        result = compute(session_id(), lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m))
    except RunFailed as error:
        bar.empty()
        cancel.empty()
        st.error(f"The run did not finish: {error}")
        st.stop()
    bar.empty()
    cancel.empty()
    return result
