"""A Compare run from the page, counted end to end: one submit to the model's engine, one request turned into a job,
one read of the result store, and every forward on the engine's one thread, with no other kvviz thread."""

import threading
import uuid
from pathlib import Path

from streamlit.testing.v1 import AppTest

from kvviz.runs import CompareRequest, ResultStore
from kvviz.runtime.engine import Engine
from kvviz.runtime.settings import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]


def test_a_compare_run_from_the_page_is_one_submit_and_one_result(monkeypatch):
    from kvviz_app.chrome import cached_model

    loaded = cached_model(DEFAULT_MODEL)  # the server's model, which the page reads
    engine = loaded.engine
    jobs, reads, submits, forwards = [], [], [], set()
    make_job, load, submit_all = CompareRequest.job, ResultStore.load, Engine.submit_all
    monkeypatch.setattr(CompareRequest, "job", lambda self, loaded: jobs.append(self) or make_job(self, loaded))
    monkeypatch.setattr(ResultStore, "load", lambda self, *args: reads.append(args) or load(self, *args))
    monkeypatch.setattr(Engine, "submit_all", lambda self, jobs, *args, **kwargs: submits.append(len(jobs))
                        or submit_all(self, jobs, *args, **kwargs))
    hook = loaded.model.register_forward_pre_hook(lambda module, args: forwards.add(threading.current_thread()))

    app = AppTest.from_file(str(ROOT / "views" / "2_Compare.py"), default_timeout=300)
    app.query_params["m"], app.query_params["n"] = ["full", "window:window=12"], "3"
    app.run()
    app.text_area(key="compare_text").set_value(f"Name two planets ({uuid.uuid4().hex[:6]}).").run()  # never stored
    history = len(engine.history)
    try:
        next(b for b in app.button if b.proto.type == "primary").click().run()
    finally:
        hook.remove()
    assert not app.exception and not app.error, [str(e.value) for e in app.error]
    assert app.dataframe, "the comparison is shown"
    assert submits == [1], "one submit of one job"
    assert len(jobs) == 1 and len(reads) == 1, "one request made into a job, the result store read once"
    (finished,) = list(engine.history)[history:]
    assert finished.status.value == "done"
    assert {thread.name for thread in forwards} == {"kvviz-engine"}, "every forward on the engine's thread"
    kvviz_threads = {thread.name for thread in threading.enumerate() if thread.name.startswith("kvviz")}
    assert kvviz_threads <= {"kvviz-engine"}, f"no thread but the engine's: {kvviz_threads}"
