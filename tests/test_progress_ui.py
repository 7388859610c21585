"""The progress bar and Cancel around a run on the engine, in a real script run (AppTest): the run's handle is found
through the session's own state, and a cancelled run leaves nothing behind."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest


def _page_cancelled_while_running() -> None:
    """A run that works until stopped; its progress report presses Cancel, as a user would while it runs."""
    import time

    import streamlit as st

    from kvviz.runtime.admission import RunSize
    from kvviz.runtime.engine import Engine
    from kvviz.runtime.jobs import Job, Stage
    from kvviz_app.progress_ui import HANDLE_KEY, cancel_run, follow, with_progress

    st.session_state["asked"] = "the request the page's button kept"

    def works_until_stopped(report):
        while True:  # the engine closes these steps once the run is cancelled
            report(0.5, "working")
            yield Stage.MEASURE
            time.sleep(0.02)

    def press_cancel(fraction: float, message: str) -> None:
        st.session_state["handle_seen"] = st.session_state.get(HANDLE_KEY) is not None
        cancel_run("asked")

    engine, job = Engine(None, "cpu"), Job(works_until_stopped, RunSize())
    with_progress(lambda user, progress: follow(engine, job, user, press_cancel), "Starting…", "asked")


def test_cancel_finds_this_sessions_run_in_its_state_and_forgets_the_request():
    app = AppTest.from_function(_page_cancelled_while_running, default_timeout=30).run()
    assert not app.exception, app.exception and app.exception[0].value
    assert [e.value for e in app.error] == ["The run did not finish: cancelled"]
    assert app.session_state["handle_seen"], "the Cancel callback found the run through the session's state"
    assert "asked" not in app.session_state, "the cancelled request is forgotten: the page does not ask again"
    assert "kvviz_handle" not in app.session_state, "the finished run's handle is gone from the session"
    assert app.session_state["kvviz_notice"] == "Run cancelled."


def test_each_session_has_its_own_id_in_the_queue():
    def page() -> None:
        import streamlit as st

        from kvviz_app.progress_ui import session_id

        st.write(session_id())
        st.write(session_id())

    first, second = AppTest.from_function(page).run(), AppTest.from_function(page).run()
    assert first.markdown[0].value == first.markdown[1].value, "one id for the whole session"
    assert first.markdown[0].value != second.markdown[0].value, "another tab, another user for the engine's fairness"
