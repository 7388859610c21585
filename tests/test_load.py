"""Many students at once: concurrent Compare sessions through the shared queue, and a soak of repeated runs.

Bounded and local: a few in-process AppTest sessions, no network traffic.
"""

import threading
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvviz.runqueue import RunQueue
from kvviz.session import compare, encode_prompt

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Name two planets.", "Say hello in French.", "What is two plus two?"]
SPECS = ["full", "window:window=12"]


def _compare_page(prompt: str) -> AppTest:
    """A student's Compare page with the prompt typed in, ready to press Run."""
    app = AppTest.from_file(str(ROOT / "pages" / "2_Compare.py"), default_timeout=600)
    for key, value in {"m": SPECS, "n": "5"}.items():
        app.query_params[key] = value
    app.run()
    app.text_area(key="compare_text").set_value(prompt).run()
    return app


@pytest.mark.slow
def test_concurrent_sessions_all_complete_with_single_user_results(real_model):
    apps = {prompt: _compare_page(prompt) for prompt in PROMPTS}  # pages open; the runs start together
    errors: list[BaseException] = []

    def student(prompt: str) -> None:
        try:
            apps[prompt].button[0].click().run()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=student, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors
    for prompt in PROMPTS:
        app = apps[prompt]
        assert not app.exception and not app.error, [e.value for e in app.error]
        ids = encode_prompt(real_model.tokenizer, prompt, chat=True)
        alone = compare(real_model, ids, SPECS, 5)
        shown = app.dataframe[0].value
        assert list(shown["method"]) == SPECS
        for result, (_, row) in zip(alone.results, shown.iterrows(), strict=True):
            assert row["agreement"] == pytest.approx(result.agreement_with_full)
            assert row["KV bytes"] == result.kv_bytes
            expected = -1 if result.first_divergence is None else result.first_divergence
            assert (-1 if pd.isna(row["first divergence"]) else row["first divergence"]) == expected


def test_queue_order_is_fair_under_load():
    queue = RunQueue()
    gate = threading.Event()
    order: list[str] = []
    queue.submit("teacher", lambda progress: gate.wait(5))
    tickets = [queue.submit(user, lambda progress, user=user: order.append(user))
               for user in ["ann", "ann", "ann", "bob", "cat", "bob"]]
    gate.set()
    for ticket in tickets:
        assert ticket.done.wait(5)
    assert order == ["ann", "bob", "cat", "ann", "bob", "ann"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
def test_soak_repeated_runs_do_not_grow_memory(real_model):
    ids = encode_prompt(real_model.tokenizer, "Describe the sea in one line.", chat=True)
    queue = RunQueue()
    specs = ["full", "h2o:heavy=8,recent=8", "kivi:bits=2,residual=0"]

    def one_run() -> None:
        ticket = queue.submit("soak", lambda progress: compare(real_model, ids, specs, 6, progress=progress))
        assert ticket.done.wait(300) and ticket.status == "done", ticket.error

    for _ in range(2):  # warm-up: allocator pools and lazy imports settle
        one_run()
    before = _rss_mb()
    for _ in range(8):
        one_run()
    growth = _rss_mb() - before
    assert growth < 64, f"process memory grew {growth:.1f} MB over 8 comparisons"
