"""Every page's default run on Gemma 3 270M, the second embedded model, in headless chromium: no exception.

The served app (the session's one server) loads Gemma once, when the first page names it. Each page opens with
``?model=gemma3-270m``; where it has a run button, its defaults run (Trade-offs' for one round of items: its time
budget, not the model, sets how long its default run lasts, and test_browser.py waits for that one). Screenshots of
what only Gemma shows (layer types, chat off) land in docs/screenshots/gemma-*.png.
"""

from __future__ import annotations

import pytest

from kvviz.bench import dom
from tests.test_browser import no_exception, ready, settle, shoot

pytestmark = pytest.mark.browser
GEMMA = "model=gemma3-270m"
RUN = 1500  # seconds a default run may take on a busy 2-core CPU (Gemma's forward costs ~3x SmolLM2's)


def ran(page, url: str, button: str, done: str) -> str:
    """Open ``url``, press its run button, wait for ``done`` and the end of the script run; the page's text."""
    ready(page, url, button).click()
    page.get_by_text(done).first.wait_for(timeout=RUN * 1000)
    settle(page, RUN)
    no_exception(page)
    assert page.locator(dom.EXCEPTION).count() == 0
    return page.inner_text("body")


def test_architectures_gemma3_every_page_s_default_run_in_chromium(server, page):
    page.goto(f"{server}/?{GEMMA}", timeout=120_000)
    page.get_by_text("Model card").wait_for(timeout=300_000)
    settle(page)
    formula = "2 * 3 global layers * 1 kv_heads * 256 head_dim"
    page.get_by_text(formula).first.wait_for(timeout=60_000)
    body = page.inner_text("body")
    assert "15 local (window 512) + 3 global of 18 layers" in body and "Gemma Terms of Use" in body
    no_exception(page)
    shoot(page, "gemma-home")

    page.goto(f"{server}/Attention?{GEMMA}", timeout=60_000)
    page.get_by_text("Heavy hitters").wait_for(timeout=300_000)
    settle(page)
    no_exception(page)
    assert "has no chat template" in page.inner_text("body")

    body = ran(page, f"{server}/Compare?{GEMMA}", "Run comparison", "configurations on")
    assert page.locator(dom.ERROR).count() == 0, "every default configuration ran"
    page.locator(dom.BUTTON_GROUP).get_by_text("Memory", exact=True).click()
    page.get_by_text("KV bytes per layer at the end").wait_for(timeout=60_000)
    settle(page)
    no_exception(page)
    assert "global" in page.inner_text("body") and "local 512" in page.inner_text("body")  # layouts per layer type
    shoot(page, "gemma-compare-memory", element=f"{dom.PLOT} >> nth=4")

    ran(page, f"{server}/Needle?{GEMMA}", "Run the grid", "Grid as CSV")
    page.goto(f"{server}/Memory_planner?model_config=Gemma-3-27B&context=131072&{GEMMA}", timeout=60_000)
    page.get_by_text("Sequences that fit").first.wait_for(timeout=120_000)
    settle(page)
    no_exception(page)
    assert "past the 1024-token window (10 global layers)" in page.inner_text("body")

    body = ran(page, f"{server}/Lessons?step=7&{GEMMA}", "Measure both models", "Notice:")
    assert "Eviction to 256 tokens saves SmolLM2" in body and "This model is a base model" in body
    shoot(page, "gemma-lessons-step7", anchor="Lessons: KV caches in 7 steps")
    ran(page, f"{server}/Tail_risk?{GEMMA}", "Run the tasks", "Runs as CSV")
    ran(page, f"{server}/Prefix_reuse?{GEMMA}", "Run prefix reuse", "Turns sharing a preamble")
    ran(page, f"{server}/Trade_offs?cap=16&{GEMMA}", "Run the sweep", "Points as CSV")


def test_architectures_smollm2_default_runs_the_other_browser_tests_leave_out(server, page):
    """The default model's runs no other browser test presses with the page's defaults (test_browser.py runs
    Compare's, Trade-offs' and lesson steps 1, 2, 3 and 5): Needle, Tail risk, Prefix reuse and lesson step 7."""
    ran(page, f"{server}/Needle", "Run the grid", "Grid as CSV")
    ran(page, f"{server}/Tail_risk", "Run the tasks", "Runs as CSV")
    ran(page, f"{server}/Prefix_reuse", "Run prefix reuse", "Turns sharing a preamble")
    body = ran(page, f"{server}/Lessons?step=7", "Measure both models", "Notice:")
    assert "gemma3-270m" in body and "This model is a base model" not in body
