"""End to end in a real browser: serve the app, visit every page in headless chromium, run a comparison.

Screenshots of each page land in docs/screenshots/ (docs/architecture.md shows them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.bench import browser, dom

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "docs" / "screenshots"
SPECS = ["full", "streaming_llm:sinks=2,window=16", "kivi:residual=0"]

pytestmark = pytest.mark.browser


def settle(page, timeout: float = 240) -> None:
    """Wait until the script run finished; longer pauses than the bench's, for a machine busy with other tests."""
    browser.settle(page, timeout, pause=0.8)


def no_exception(page) -> None:
    assert page.locator(dom.EXCEPTION).count() == 0, page.inner_text("body")[:2000]


def shoot(page, name: str, anchor: str | None = None, element: str | None = None) -> None:
    """Screenshot the page, scrolled so that the heading ``anchor`` (or the first ``element``, a CSS selector) is at
    the top when given."""
    target = page.get_by_role("heading", name=anchor) if anchor is not None else None
    target = page.locator(element) if element is not None else target
    if target is not None:
        target.first.evaluate("element => element.scrollIntoView()")
        page.wait_for_timeout(500)
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if path.stat().st_size > 300_000:  # keep the repository light: fall back to the first screen
        page.screenshot(path=str(path))


def ready(page, url: str, button: str):
    """Open ``url`` and wait for its run button ``button`` and the end of the script run; the button."""
    page.goto(url, timeout=120_000)
    run = page.get_by_role("button", name=button)
    run.wait_for(timeout=180_000)
    settle(page)
    return run


def inotify_watches(pid: int) -> int:
    """File watches the process holds (each inotify instance lists its watches in /proc/PID/fdinfo)."""
    watches = 0
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            watches += info.read_text().count("inotify wd:")
        except OSError:  # the descriptor closed meanwhile
            continue
    return watches


def test_served_app_watches_no_files_and_deep_links_show_only_the_pages(server, served, page):
    """Serving (``make run``, the container) reads .streamlit/config.toml: no file watcher, even once a browser
    session is open (Streamlit starts watching per session; watching .venv cost about one core)."""
    page.goto(f"{server}/Memory_planner")
    settle(page)
    assert inotify_watches(served.pid) == 0
    entries = page.locator(dom.SIDEBAR_NAV_LINK).all_inner_texts()
    assert entries and "Home" in entries[0] and not any(e.strip() == "app" for e in entries), entries


def test_every_page_in_chromium(server, page):
    page.goto(server, timeout=120_000)
    page.get_by_text("Model card").wait_for(timeout=180_000)
    settle(page)
    page.locator(dom.PLOT).first.wait_for(timeout=60_000)
    no_exception(page)
    formula = "2 * 30 layers * 3 kv_heads * 64 head_dim"  # a code block, drawn after the script ends
    page.get_by_text(formula).first.wait_for(timeout=60_000)
    assert formula in page.inner_text("body")
    shoot(page, "home")

    page.goto(f"{server}/Attention?layer=14&head=3", timeout=60_000)
    page.get_by_text("Heavy hitters").wait_for(timeout=180_000)
    settle(page)
    assert page.locator(dom.PLOT).count() == 3
    no_exception(page)
    shoot(page, "attention")
    shoot(page, "attention-heatmap", anchor="Layer 14, head 3")

    query = "&".join(f"m={spec}" for spec in SPECS)
    ready(page, f"{server}/Compare?{query}&n=4", "Run comparison").click()
    page.get_by_text("configurations on").wait_for(timeout=240_000)
    settle(page)
    body = page.inner_text("body")
    for spec in SPECS:
        assert spec in body
    assert page.locator(dom.PLOT).count() == 0, "diagnostics are drawn when asked for"
    assert "Results as CSV" in body
    no_exception(page)
    # the other diagnostics are a click away
    page.locator(dom.BUTTON_GROUP).get_by_text("Kept tokens", exact=True).click()
    page.get_by_text("of prompt tokens cached").wait_for(timeout=60_000)
    settle(page)
    assert page.locator(dom.PLOT).count() == 1
    # a rerun replays the cached comparison (no model work) and must render the same way
    page.get_by_role("slider").first.focus()
    page.keyboard.press("ArrowRight")
    page.get_by_text("layer 1, after step").wait_for(timeout=60_000)
    settle(page)
    no_exception(page)
    shoot(page, "compare-kept", anchor="Diagnostics")
    shoot(page, "compare", anchor="Outputs")

    ready(page, f"{server}/Needle", "Run the grid")
    no_exception(page)
    shoot(page, "needle")

    page.goto(f"{server}/Memory_planner?model_config=Qwen2.5-7B&kvbits=4&evict=ratio", timeout=60_000)
    page.get_by_text("Sequences that fit").first.wait_for(timeout=60_000)
    settle(page)
    assert page.locator(dom.PLOT).count() == 2
    no_exception(page)
    shoot(page, "planner")

    ready(page, f"{server}/Lessons?step=3", "Measure the sinks")
    no_exception(page)
    shoot(page, "lessons")


def test_bad_uploads_get_a_message_and_the_page_keeps_working(server, tmp_path, page):
    """Binary and non-UTF-8 prompt files, uploaded through the real file picker."""
    binary = tmp_path / "notes.txt"
    binary.write_bytes(b"PK\x03\x04\x00\x00binary")
    latin = tmp_path / "essay.md"
    latin.write_bytes("café au lait".encode("latin-1"))
    run = ready(page, f"{server}/Compare?m=full&n=2", "Run comparison")
    upload = page.locator(dom.FILE_INPUT).first
    upload.set_input_files(str(binary))
    page.get_by_text("looks binary").wait_for(timeout=60_000)
    settle(page)
    no_exception(page)
    assert run.is_disabled(), "a rejected upload runs nothing"
    upload.set_input_files(str(latin))
    page.get_by_text("is not UTF-8 text").wait_for(timeout=60_000)
    settle(page)
    no_exception(page)
    assert run.is_visible(), "the page still works"
    assert run.is_disabled(), "no silent fallback to the box"


def test_the_bench_times_a_text_from_the_dom_change_that_shows_it(page):
    """The app section's clock for "results shown": the page's time of the change that drew the text, found without
    polling the page (the bench's waits shared the model's two cores); already shown means now, never shown fails."""
    from playwright.sync_api import Error

    page.set_content("<p>waiting</p><script>setTimeout(() => { const line = document.createElement('p');"
                     " line.textContent = '6 configurations on ' + 2025 + ' prompt tokens';"
                     " document.body.append(line);"
                     " window.drawnAt = performance.now(); }, 400)</script>")
    started = page.evaluate("() => performance.now()")
    shown = browser.text_shown(page, "on 2025 prompt tokens", timeout=10)
    assert shown == pytest.approx(page.evaluate("() => window.drawnAt"), abs=20) and shown - started >= 350
    assert browser.text_shown(page, "waiting", timeout=1) >= shown, "a text already there counts from now"
    with pytest.raises(Error, match="not shown within 300 ms"):
        browser.text_shown(page, "on 4096 prompt tokens", timeout=0.3)


def test_compare_defaults_evict_quantize_and_depart_from_full(server, page):
    run = ready(page, f"{server}/Compare", "Run comparison")  # the default configurations and prompt
    assert page.get_by_role("textbox", name="Prompt").input_value().startswith("Every autumn")
    run.click()
    page.locator(dom.PROGRESS).wait_for(timeout=60_000)
    assert page.locator(dom.STATUS_WIDGET).count() == 0, "no header, no animated icon"
    page.get_by_text("configurations on").wait_for(timeout=600_000)
    settle(page)
    no_exception(page)
    assert page.locator(dom.ERROR).count() == 0, "every default method ran"
    body = page.inner_text("body")
    assert "Ines" in page.locator(dom.HTML).first.inner_text(), "full's answer is right"
    divergences = body.count("first divergence none")
    assert body.count("agreement with full") - divergences >= 1, "at least one output departs from full"
    shoot(page, "compare-defaults", anchor="Outputs")
    page.locator(dom.BUTTON_GROUP).get_by_text("Kept tokens", exact=True).click()
    page.get_by_text("of prompt tokens cached").wait_for(timeout=60_000)
    assert "Nothing was evicted" not in page.inner_text("body")

    ready(page, f"{server}/Compare?m=full&n=200", "Run comparison").click()  # a longer run, cancelled
    page.get_by_role("button", name="Cancel run").click(timeout=60_000)
    page.get_by_text("Run cancelled.").wait_for(timeout=60_000)
    assert page.get_by_text("configurations on").count() == 0 and "press Run comparison" in page.inner_text(
        "body"), "the cancelled run shows nothing and is not asked for again"


def test_long_upload_is_cut_in_the_middle_without_an_error(server, tmp_path, page):
    long_file = tmp_path / "play.txt"
    long_file.write_text("ACT ONE. The storm rolled over the harbour. " + "The sailors ran. " * 2500
                         + "\n\nQuestion: what rolled over the harbour?")
    run = ready(page, f"{server}/Compare?m=full&n=2", "Run comparison")
    page.locator(dom.FILE_INPUT).first.set_input_files(str(long_file))
    page.get_by_text("Cut the middle to fit").wait_for(timeout=120_000)
    settle(page)
    assert page.locator(dom.ERROR).count() == 1
    page.get_by_text("Cut the middle to fit").click()
    page.get_by_text("from the middle of the document").wait_for(timeout=120_000)
    settle(page)
    no_exception(page)
    assert page.locator(dom.ERROR).count() == 0, "no error once accepted"
    assert run.is_enabled()


def test_planner_at_128k_and_the_llama_13b_numbers(server, page):
    page.goto(f"{server}/Memory_planner?model_config=Llama-3.1-70B&context=131072&batch=1", timeout=120_000)
    page.get_by_text("KV per sequence (131,072 tokens)").wait_for(timeout=120_000)
    settle(page)
    no_exception(page)
    assert "42.95 GB" in page.inner_text("body"), "a 128K context pins tens of GB per sequence"
    ticks = page.locator(f"{dom.PLOT} .ytick text").all_text_contents()
    assert ticks and not any("e+" in t or len(t) > 8 for t in ticks), ticks
    shoot(page, "planner-128k")
    page.goto(f"{server}/Memory_planner?model_config=LLaMA-13B&context=2048&batch=1", timeout=120_000)
    page.get_by_text("KV per sequence (2,048 tokens)").wait_for(timeout=120_000)
    settle(page)
    body = page.inner_text("body")
    assert "0.82 MB" in body and "1.68 GB" in body


def test_lesson_steps_show_a_correct_reference(server, page):
    for step, button in ((1, "Generate and measure"), (2, "Compare the levers"), (3, "Measure the sinks"),
                         (5, "Hide the needle")):
        ready(page, f"{server}/Lessons?step={step}", button).click()
        page.get_by_text("Reference: the full cache answers").wait_for(timeout=600_000)
        settle(page)
        no_exception(page)
        shoot(page, f"lessons-step{step}")


def test_bad_links_say_what_they_changed_and_run_nothing(server, page):
    """The issue's links, as a new user would paste them: a notice or the SPEC's error for each, no exception."""
    page.set_viewport_size({"width": 1400, "height": 2000})  # the configurations' errors in view
    run = ready(page, f"{server}/Compare?n=-3&m=nope&m=full&m=%3Cimg%20src%3Dx%3E&ctx=1", "Run comparison")
    no_exception(page)
    body = page.inner_text("body")
    assert "n=-3 is below 1, the least allowed; using 1." in body
    assert "unknown method 'nope'; valid:" in body and "unknown method '<img src=x>'" in body
    assert "This page has no setting ctx=1" in body
    assert page.locator("img[src=x]").count() == 0, "markup from a link is shown, never rendered"
    assert run.is_disabled()
    shoot(page, "compare-bad-link")
    for link, said in (("Attention?layer=999&head=-1", "layer=999 is over 29"),
                       ("Needle?len=abc&len=999999", "len=abc, len=999999 are not among"),
                       ("Tail_risk?task=nope", "task=nope is not among"),
                       ("Memory_planner?model=nope&ctx=-1", "model=nope is neither"),
                       ("?model=%2Fetc", "model=/etc is neither")):
        page.goto(f"{server}/{link}", timeout=120_000)
        page.get_by_text(said).first.wait_for(timeout=180_000)
        settle(page)
        no_exception(page)


def test_trade_offs_default_run_draws_intervals_cliffs_and_the_item_grid(server, page):
    # three families on multikey items of 256 tokens, adaptive: rounds until every point is decided (or 165 s)
    ready(page, f"{server}/Trade_offs", "Run the sweep").click()
    page.locator(dom.RUNNING).wait_for(timeout=60_000)
    page.wait_for_timeout(700)  # the still label shows once a run has lasted half a second
    label = page.locator(dom.APP).evaluate(
        "app => [getComputedStyle(app, '::after').content, getComputedStyle(app, '::after').visibility]")
    assert label == ['"Running…"', "visible"], label
    assert page.locator(dom.STATUS_WIDGET).count() == 0, "no header, no animated icon"
    page.get_by_text("Items each point used").first.wait_for(timeout=600_000)
    settle(page)
    no_exception(page)
    page.locator(dom.PLOT).nth(1).wait_for(timeout=60_000)  # plotly draws after the script ends
    assert page.locator(dom.PLOT).count() == 5, "the trade-off chart, the items each point used, each family's grid"
    body = page.inner_text("body")
    assert "What this run can decide" in body, "the plan, on screen before the run"
    assert "The full cache is right on" in body and "multikey items" in body, "full's real accuracy"
    assert "betting confidence sequence" in body and "closed procedure" in body and "Holm" in body, "the rules"
    assert "indistinguishable" not in body, "the verdict words of earlier rounds"
    items_chart = page.locator(dom.PLOT).nth(1).inner_text()
    assert "proven beyond the margin" in items_chart, "the items chart: why points stopped"
    chart = page.locator(dom.PLOT).first.inner_text()
    assert "frontier" in chart and "full's 95% interval" in chart
    shoot(page, "tradeoffs", element=dom.PLOT)
    shoot(page, "tradeoffs-items", anchor="Every item, every budget")
