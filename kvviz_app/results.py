"""How a page gets a result, the one way every page does: it names a request (:mod:`kvviz.runs`) and
:func:`result_for` returns its result from this server's memory, else the result store on disk, else one job
submitted to the model's engine (round-robin across users, runs admitted together decoding in one batch), stored for
next time.

A page with a run button draws it with :func:`run_button`, which keeps the request pressed in the session, and shows
the result with :func:`run_pressed`; a section that runs only once asked draws :func:`stays_pressed`.
"""

from __future__ import annotations

import streamlit as st

from kvviz.runs import ResultStore, RunRequest
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz_app.progress_ui import follow, show_notice, with_progress
from kvviz_app.recent import recent_results


@st.cache_resource(show_spinner=False)
def result_store() -> ResultStore:
    """Results on disk, shared with the class warm-up (``make warm``) and later server processes."""
    return ResultStore.default()


def stored_or_run(loaded: LoadedModel, request: RunRequest, user: str, progress: Progress) -> object:
    """A request's result from the result store (read once), else its job submitted to the model's engine and
    followed (one submit, one result), then stored. Another session asking for the same request meanwhile waits for
    this one in :func:`result_for` and finds the result in memory."""
    store = result_store()
    found = store.load(loaded, request)
    if found is None:
        found = follow(loaded.engine, request.job(loaded), user, progress)
        store.save(loaded, request, found)
    return found


def result_for(loaded: LoadedModel, request: RunRequest, start_text: str = "Starting…",
               request_key: str | None = None) -> object:
    """A request's result: from this server's memory at once, else from the store or a run on the model's engine,
    with a progress bar and a Cancel button (which also forgets the request pressed under ``request_key``)."""
    key = f"{loaded.name}:{loaded.device}:{request!r}"
    memory = recent_results()
    found = memory.get(key)
    if found is None:
        with memory.computing(key):
            found = memory.get(key)  # another session may have fetched it while this one waited
            if found is None:
                found = with_progress(lambda user, progress: stored_or_run(loaded, request, user, progress),
                                      start_text, request_key)
                memory.put(key, found)
    return found


def run_button(label: str, key: str, request: object, *, disabled: bool = False) -> bool:
    """The page's run button: pressing it keeps ``request`` (what the page would run now) under ``key`` in the
    session, where :func:`pressed` finds it on this and every later rerun until the button is pressed again.
    Returns whether it was pressed on this run (a page may keep more beside the request)."""
    if st.button(label, type="primary", disabled=disabled):
        st.session_state[key] = request
        return True
    return False


def pressed(key: str, waiting: str, current: object | None = None) -> object:
    """What the page's run button kept under ``key``. Until it is pressed the page shows ``waiting`` (after any notice
    a cancelled run left) and stops; when the page's settings now ask for something else (``current``), a caption says
    the results are the last run's."""
    request = st.session_state.get(key)
    if request is None:
        show_notice()  # a cancelled run forgets its request: say so here, not at the next run
        st.info(waiting)
        st.stop()
    if current is not None and request != current:
        st.caption("Showing the last run; the settings above have changed since. Press the run button again.")
    return request


def run_pressed(loaded: LoadedModel, key: str, waiting: str, start_text: str,
                current: RunRequest | None = None) -> tuple[RunRequest, object]:
    """The request the page's run button kept under ``key`` (:func:`pressed`) and its result (:func:`result_for`);
    a request the engine refuses (ValueError) shows its one-line message and stops the page."""
    request = pressed(key, waiting, current)
    try:
        return request, result_for(loaded, request, start_text, request_key=key)
    except ValueError as error:
        st.error(str(error))
        st.stop()


def stays_pressed(label: str, key: str) -> bool:
    """A button for a section whose run costs more than the page's own (a lesson step, a later study): pressed once,
    it stays on while the page is shown, so the section's result survives the reruns other widgets cause."""
    if st.button(label, type="primary", key=key):
        st.session_state[f"{key}_on"] = True
    return bool(st.session_state.get(f"{key}_on"))
