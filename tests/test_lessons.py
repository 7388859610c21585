"""The Lessons page's material: every step's reference (the full cache) gives the right answer on the default model,
and the settings produce the contrast the step teaches."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.comparison.session import compare
from kvviz.lessons import NEEDLE_CODE, RUNS, is_filler_token, span_of, step_requests
from kvviz.runs import CompareRequest

LESSONS_PAGE = Path(__file__).resolve().parents[1] / "views" / "5_Lessons.py"


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run.expected])
def test_each_step_reference_answers_correctly(real_model, name):
    run = RUNS[name]
    full = compare(real_model, run.token_ids(real_model.tokenizer), ["full"], run.max_new_tokens).results[0]
    assert run.expected in full.text, f"step {name!r}: the full cache answered {full.text!r}"


def test_sinks_step_window_loses_the_answer_that_sinks_keep(real_model):
    run = RUNS["sinks"]
    full, window, streaming = compare(real_model, run.token_ids(real_model.tokenizer), list(run.specs),
                                      run.max_new_tokens).results
    assert run.expected in full.text and run.expected in streaming.text
    assert window.agreement_with_full < streaming.agreement_with_full
    assert window.kv_bytes == streaming.kv_bytes, "the same budget with and without sinks"


def test_needle_position_and_filler_words(real_model):
    run = RUNS["needle"]
    ids = run.token_ids(real_model.tokenizer)
    span = span_of(real_model.tokenizer, ids, NEEDLE_CODE)
    assert NEEDLE_CODE in real_model.tokenizer.decode([ids[i] for i in span])
    assert NEEDLE_CODE not in real_model.tokenizer.decode([ids[i] for i in span[1:]]), "the shortest span"
    assert is_filler_token(" the") and is_filler_token(".") and not is_filler_token(" Ines")


def test_links_carry_the_same_settings():
    link = RUNS["sinks"].link()
    assert link.startswith("Compare?") and "m=window%3Awindow%3D40" in link and "n=32" in link and "prompt=" in link


class _Stopped(Exception):
    """Raised instead of running a comparison: the test needs the request, not its result."""


def test_each_step_runs_the_requests_the_bench_times(real_model, monkeypatch):
    """The classroom bench section (and scripts/gpu_check.sh) time ``step_requests``; the page must run exactly those.
    Attention requests run for real (short prompts), comparisons are recorded and stopped."""
    from kvviz_app import results

    asked = []

    def record(loaded, request, *args, **kwargs):
        asked.append(request)
        if isinstance(request, CompareRequest):
            raise _Stopped
        return request.run(loaded)

    monkeypatch.setattr(results, "result_for", record)
    expected = step_requests(real_model)
    for number, (key, requests) in enumerate(expected.items(), 1):
        asked.clear()
        app = AppTest.from_file(str(LESSONS_PAGE), default_timeout=300)
        app.query_params["step"] = str(number)
        app.run()
        app.button(key=f"lesson_button_{number}").click().run()
        assert tuple(asked) == requests, f"step {number} ({key})"
    assert len(expected) == len(app.radio(key="step").options), "every step of the page is timed"
