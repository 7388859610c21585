"""Faults a classroom meets, through the real pages: the message shown, and the app healthy afterwards."""

from pathlib import Path

import torch
from streamlit.testing.v1 import AppTest

import kvviz.comparison.session

ROOT = Path(__file__).resolve().parents[1]
SHORT = "Name one planet."


def _compare(**params) -> AppTest:
    app = AppTest.from_file(str(ROOT / "views" / "2_Compare.py"), default_timeout=300)
    for key, value in params.items():
        app.query_params[key] = value
    return app.run()


def _errors(app: AppTest) -> str:
    return " ".join(str(e.value) for e in app.error)


def _run(app: AppTest, prompt: str) -> AppTest:
    app.text_area(key="compare_text").set_value(prompt).run()
    app.button[0].click().run()
    return app


def test_too_long_prompt_offers_truncation_then_runs(monkeypatch):
    monkeypatch.setenv("KVVIZ_MAX_PROMPT_TOKENS", "80")
    app = _compare(m=["full"], n="2")
    app.text_area(key="compare_text").set_value("word " * 200 + "How many words?").run()
    assert "this server allows 80" in _errors(app)
    truncate = next(t for t in app.toggle if t.label.startswith("Cut the middle to fit 80"))
    truncate.set_value(True).run()
    assert not app.error, "no error stays once the user accepted the cut"
    assert any("from the middle of the document" in i.value for i in app.info)
    app.button[0].click().run()
    assert not app.exception
    tokens = [int(s.value.split(" on ")[1].split()[0]) for s in app.success if s.value.startswith("1 configuration on")]
    assert tokens and tokens[0] <= 80


def test_disallowed_model_in_class_mode_is_refused_and_the_page_still_works(monkeypatch):
    monkeypatch.setenv("KVVIZ_ALLOWED_MODELS", "smollm2-135m-instruct")
    app = _compare(model="evil/remote-code-model", m=["full"], n="2")
    assert not app.exception
    assert any("is not offered on this server" in w.value for w in app.warning)
    assert app.selectbox(key="model_name").value == "smollm2-135m-instruct"
    _run(app, SHORT)
    assert not app.exception and app.dataframe


def test_bad_method_parameters_are_shown_beside_the_widget():
    app = _compare(m=["full"], n="2")
    app.text_input(key="cfg0_spec").set_value("window:window=-3").run()
    assert not app.exception
    assert "bad value in 'window:window=-3'" in _errors(app)
    run = app.button[0]
    assert run.disabled, "nothing runs until the configuration is valid"
    app.text_input(key="cfg0_spec").set_value("window:window=8").run()
    assert not app.error and not app.button[0].disabled


def test_a_crash_inside_one_method_leaves_the_others_standing(monkeypatch):
    from kvviz.methods.window import Window

    def flaky(self, view):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(Window, "select", flaky)
    app = _run(_compare(m=["full", "window:window=8"], n="3"), "Say hi twice.")
    assert not app.exception
    table = app.dataframe[0].value
    assert table["error"][0] == "" and "simulated kernel failure" in table["error"][1]


def test_out_of_memory_names_the_setting_and_the_next_run_works(monkeypatch):
    original = kvviz.comparison.session.compare_steps
    calls = {"n": 0}

    def once_out_of_memory(*args, **kwargs):  # the comparison's first state fails on the engine, as a forward would
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    monkeypatch.setattr("kvviz.comparison.session.compare_steps", once_out_of_memory)
    app = _run(_compare(m=["full"], n="2"), "Count to three, slowly.")
    assert "ran out of memory" in _errors(app) and "max new tokens" in _errors(app)
    assert not app.exception
    app.button[0].click().run()
    assert not app.exception and app.dataframe, "the server keeps serving after the failure"


def test_unreachable_hub_is_a_message_and_the_default_still_works(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what a classroom without internet looks like to the hub client
    app = AppTest.from_file(str(ROOT / "views" / "2_Compare.py"), default_timeout=300)
    app.query_params["model"] = "nobody-here/not-cached-model"
    app.run()
    assert not app.exception
    assert "Could not load nobody-here/not-cached-model" in " ".join(str(e.value) for e in app.sidebar.error)
    app.selectbox(key="model_name").set_value("smollm2-135m-instruct").run()
    assert not app.exception and not app.sidebar.error
