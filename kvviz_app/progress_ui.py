"""A run in the server's scheduler (:mod:`kvviz.runtime.scheduler`), shown on the page as a progress bar with a
Cancel button: first the place in line, then the run's own progress."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from kvviz.runtime.admission import RunSize
from kvviz.runtime.faults import describe_error
from kvviz.runtime.progress import Progress
from kvviz.runtime.scheduler import DONE, Scheduler, Ticket
from kvviz.runtime.together import RUNS_TOGETHER

T = TypeVar("T")
PROGRESS_EVERY = 2.0  # seconds between progress bar updates
SESSION_KEY = "kvviz_session_id"  # session state: this browser session's id, its name in the queue
TICKET_KEY = "kvviz_ticket"  # session state: this session's run in the queue while the page waits for it (Cancel)
NOTICE_KEY = "kvviz_notice"  # session state: a message for the next rerun ("Run cancelled.")


class RunFailed(Exception):
    """A queued run that did not finish: cancelled, abandoned or failed (the message says which and why)."""


@st.cache_resource(show_spinner=False)
def run_queue() -> Scheduler:
    """One queue per server: runs on the model start round-robin across users and decode together."""
    return Scheduler(abandon_after=30.0, format_error=describe_error, together=RUNS_TOGETHER)


def session_id() -> str:
    """This browser session's name in the queue (each tab its own), made once and kept in its session state."""
    return st.session_state.setdefault(SESSION_KEY, uuid.uuid4().hex)


def queue_message(ahead: int, ticket: Ticket) -> str:
    """What the progress bar says: how many runs are ahead in line, or the run's own progress."""
    if ahead:
        return f"Queued behind {ahead} other run{'s' if ahead > 1 else ''}…"
    return "Starting…" if ticket.status == "queued" else ticket.message


def through_queue(user: str, job: Callable[[Progress], T], progress: Progress, size: RunSize | None = None) -> T:
    """Run ``job`` in the shared queue while reporting the place in line, then the run's own progress; ``size`` is
    what the queue's admission policy weighs.

    Polling keeps the run alive; a page that stops polling (closed tab, rerun, Cancel) gives its slot back. While it
    polls, the ticket sits in the session's state, where the Cancel button's callback finds it.
    """
    queue = run_queue()
    ticket = queue.submit(user, job, size)
    st.session_state[TICKET_KEY] = ticket
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
        if st.session_state.get(TICKET_KEY) is ticket:
            del st.session_state[TICKET_KEY]
    if ticket.status != DONE:
        raise RunFailed(ticket.error or ticket.status)
    return ticket.result


def cancel_run(request_key: str | None) -> None:
    """The Cancel button's callback (it runs before the rerun it causes): stop this session's run and forget the
    request that asked for it, so the page does not ask again."""
    ticket = st.session_state.get(TICKET_KEY)
    if ticket is not None:
        ticket.cancel()
    if request_key:
        st.session_state.pop(request_key, None)
    st.session_state[NOTICE_KEY] = "Run cancelled."


def show_notice() -> None:
    """The message the last rerun left for this one ("Run cancelled."), once."""
    notice = st.session_state.pop(NOTICE_KEY, None)
    if notice:
        st.info(notice)


def with_progress(compute: Callable[[str, Progress], T], start_text: str, request_key: str | None = None) -> T:
    """Show a progress bar and a Cancel button around a queued computation; stop the page on failure.

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
