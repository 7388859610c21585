"""Shared links with hostile settings: every page, every setting, opened in AppTest, then its run buttons pressed.

Opened without pressing, no model runs: the pages get the session's real model (for its tokenizer and shape) and the
run entry point is replaced by one that records the request and stops the page. Pressed, the runs are real, on the
tiny random model, through the server's queue: whatever a link set, what comes back is a page, never an exception.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.name for p in (ROOT / "views").glob("*.py"))
HOSTILE = {
    "empty": [""],
    "not a number": ["abc"],
    "negative": ["-5"],
    "huge": ["999999"],
    "unknown name": ["nope"],
    "path": ["../../etc/passwd"],
    "markup": ["<script>alert(1)</script>**x**"],
    "repeated": ["1", "2"],
}


@pytest.fixture
def runs(monkeypatch, real_model) -> list:
    """The requests pages ask to run (none runs): the page stops where its results would start."""
    import kvviz_app.chrome
    import kvviz_app.results

    asked: list = []

    def record(loaded, request, *args, **kwargs):
        asked.append(request)
        st.stop()

    monkeypatch.setattr(kvviz_app.chrome, "cached_model", lambda name, weights="auto": real_model)
    monkeypatch.setattr(kvviz_app.results, "result_for", record)
    return asked


@pytest.fixture
def tiny_pages(monkeypatch, tiny_model):
    """Pages on the tiny random model: every run is real and takes moments."""
    import kvviz_app.chrome

    monkeypatch.setattr(kvviz_app.chrome, "cached_model", lambda name, weights="auto": tiny_model)


def open_page(name: str, **params) -> AppTest:
    """A page opened from a link; Home through app.py, whose navigation its page links need."""
    script = ROOT / "app.py" if name == "0_Home.py" else ROOT / "views" / name
    app = AppTest.from_file(str(script), default_timeout=120)
    for key, value in params.items():
        app.query_params[key] = value
    return app.run()


def notices(app: AppTest) -> str:
    return "\n".join(str(e.value) for e in [*app.warning, *app.error])


def page_settings(name: str) -> list[str]:
    """The settings a page reads, as its notice for a setting it does not have lists them."""
    app = open_page(name, zzz="1")
    said = re.search(r"`zzz=1`.*Its settings: ([^.]*)\.", notices(app))
    assert said, f"{name} says nothing of a setting it does not have: {notices(app)}"
    return [s for s in said.group(1).split(", ") if s != "model"]


@pytest.mark.parametrize("page", PAGES)
def test_every_setting_of_every_page_survives_hostile_links(page, runs):
    settings = page_settings(page)
    for kind, value in HOSTILE.items():
        runs.clear()
        app = open_page(page, **dict.fromkeys(settings, value))
        assert not app.exception, f"{page} with {kind} values: {app.exception[0].value}"
        said = notices(app)
        for name in settings:
            used = app.query_params.get(name)
            untouched = (used if isinstance(used, list) else [used]) == value
            named = f"{name}=" in said or (name == "m" and all(f"'{v}'" in said for v in value))
            assert untouched or named, f"{page}: {name}={value} ({kind}) became {used} without a word; said: {said}"
        ran = [r for r in runs if type(r).__name__ != "AttentionRequest"]  # Attention draws its capture on open
        assert not ran, f"{page} ran {ran} before a run button was pressed"
        if runs:
            assert 0 <= runs[0].layer < 30


def test_the_issues_links_each_name_the_value_and_what_runs(runs):
    app = open_page("2_Compare.py", n="-3")
    assert "`n=-3` is below 1, the least allowed; using 1." in notices(app)
    app = open_page("2_Compare.py", n="999999")
    assert "`n=999999` is over 256, the most allowed here; using 256." in notices(app)
    app = open_page("1_Attention.py", layer="999", head="-1")
    assert not app.exception
    assert "`layer=999` is over 29" in notices(app) and "`head=-1` is below 0" in notices(app)
    assert app.slider(key="layer").value == 29 and app.selectbox(key="head").value == 0

    app = open_page("2_Compare.py", m=["nope", "full"])
    assert "unknown method 'nope'; valid:" in notices(app)
    assert app.button[0].disabled and "Configuration 1 has an invalid SPEC" in notices(app)
    assert app.text_input(key="cfg0_spec").value == "nope", "the link's value is shown, not replaced"
    for spec, error in (("snapkv:budget=64+h2o", "stacks two eviction methods (snapkv, h2o)"),
                        ("snapkv:budget=-5", "bad value in 'snapkv:budget=-5'"),
                        ("kivi:bits=3", "bad value in 'kivi:bits=3': choose 2|4|8")):
        app = open_page("2_Compare.py", m=spec)
        assert error in notices(app) and app.button[0].disabled, spec
    app.text_input(key="cfg0_spec").set_value("").run()  # cleared: the widgets above run
    assert not app.error and not app.button[0].disabled

    app = open_page("3_Needle.py", len=["abc", "999999"])
    assert "`len=abc`, `len=999999` are not among 128, 256" in notices(app)
    assert "using 128, 256 (the default)" in notices(app)
    assert "`task=nope` is not among" in notices(open_page("6_Tail_risk.py", task="nope"))
    said = notices(open_page("4_Memory_planner.py", model="nope", ctx="-1"))
    assert "`model=nope` is neither a model this server offers nor a hub id" in said
    assert "This page has no setting `ctx=-1`; it is ignored." in said
    assert "`model=/etc` is neither" in notices(open_page("0_Home.py", model="/etc"))
    assert all(type(r).__name__ == "AttentionRequest" for r in runs), "only Attention draws its capture on open"


def test_a_link_with_more_configurations_than_the_page_runs_names_those_left_out(runs):
    app = open_page("2_Compare.py", m=["full", "window:window=8", "window:window=16", "window:window=24",
                                       "window:window=32", "window:window=40", "window:window=48", "h2o"])
    assert "The link gives 8 configurations; this page runs at most 6, so `m=window:window=48`, `m=h2o` are left " \
           "out." in notices(app)
    app = open_page("3_Needle.py", m=["full", "full"])
    assert any(c.value == "The same as method 1: it runs once." for c in app.caption)


def test_a_notice_stays_until_its_widget_changes(runs):
    app = open_page("2_Compare.py", n="999999")
    app.text_area(key="compare_text").set_value("Another prompt.").run()
    assert "`n=999999`" in notices(app), "the link was rewritten, the notice stays"
    app.number_input(key="max_new").set_value(8).run()
    assert "`n=999999`" not in notices(app)


def test_a_trade_offs_link_opens_its_workload_families_and_budgets(runs):
    app = open_page("8_Trade_offs.py", w="task", task="multikey", len="1024", b=["0.125", "0.5"],
                    m=["snapkv", "lowrank+snapkv:budget=0.25"])
    assert not app.exception and not notices(app), notices(app)
    assert app.radio(key="sweep_workload").value == "task" and app.selectbox(key="sweep_task").value == "multikey"
    assert app.select_slider(key="sweep_task_length").value == 1024
    assert app.multiselect(key="sweep_budgets").value == [0.125, 0.5]
    assert app.multiselect(key="sweep_families").value == ["snapkv"], "an offered family fills the multiselect"
    assert app.text_input(key="sweep_extra").value == "lowrank+snapkv:budget=0.25", "any other SPEC, as given"
    assert app.query_params["m"] == ["snapkv", "lowrank+snapkv:budget=0.25"]

    app = open_page("8_Trade_offs.py", m=["snapkv", "snapkv+h2o"], b="2")
    said = notices(app)
    assert "`b=2` is not among" in said and "stacks two eviction methods (snapkv, h2o)" in said
    assert next(b for b in app.button if b.label == "Run the sweep").disabled


def unfinished(app: AppTest) -> list[str]:
    """The runs the page says did not finish (a failure in the run, not a refused setting)."""
    return [str(e.value) for e in app.error if "did not finish" in str(e.value)]


def press_run_buttons(app: AppTest) -> int:
    """Click each enabled primary button once, in page order (a run may reveal another); how many were pressed."""
    pressed: set[str] = set()
    while button := next((b for b in app.button if b.proto.type == "primary" and not b.disabled
                          and (b.key or b.label) not in pressed), None):
        pressed.add(button.key or button.label)
        button.click().run()
    return len(pressed)


RUN_PAGES = {"2_Compare.py", "3_Needle.py", "5_Lessons.py", "6_Tail_risk.py", "7_Prefix_reuse.py", "8_Trade_offs.py"}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs_what_hostile_links_leave_it(page, tiny_pages):
    """Each hostile link, then every run button pressed (the Memory planner's measured run switched on): no
    exception, and every run that starts finishes. SPECs stay valid here: an invalid one disables the run, as
    the tests above check."""
    settings = [name for name in page_settings(page) if name != "m"]
    for kind, value in HOSTILE.items():
        app = open_page(page, **dict.fromkeys(settings, value))
        if page == "4_Memory_planner.py":
            app.toggle(key="planner_measure").set_value(True).run()
        pressed = press_run_buttons(app)
        assert not app.exception, f"{page} with {kind} values, run: {app.exception[0].value}"
        assert not unfinished(app), f"{page} with {kind} values: {unfinished(app)}"
        # an empty prompt disables the run, saying why
        assert pressed or page not in RUN_PAGES or app.error, f"{page} with {kind} values ran nothing, silently"


def test_a_one_token_comparison_renders(tiny_pages):
    """The issue's link: ``n=-3`` means one token, and its comparison shows like any other, the decode-step choice
    reduced to the one step there is."""
    app = open_page("2_Compare.py", n="-3")
    assert "`n=-3` is below 1, the least allowed; using 1." in notices(app)
    next(b for b in app.button if b.label == "Run comparison").click().run()
    assert not app.exception, app.exception and app.exception[0].value
    assert any("configurations on" in s.value for s in app.success), [s.value for s in app.success]
    app.button_group(key="compare_show").set_value("Kept tokens").run()
    step = app.number_input(key="kept_step")
    assert step.value == 0 and step.disabled, "one generated token: the step after prefill is the only one"
    assert app.dataframe, "the quality and memory table is shown"
