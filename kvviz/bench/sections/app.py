"""The served app timed against its own engine, in headless chromium.

What a student feels: the app is started as ``make run`` starts it (its own process, the baked config, an empty
result store), Compare is driven through the real page (URL settings, file upload, the Run button) and timed from
the click until the results are on screen; the same comparison is timed in this process with the engine alone.
Then the same result opened again from a new browser session (cached), and every lesson step cold and warm.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from kvviz.bench.browser import CHROMIUM_ARGS, ServedApp, chromium_path, last_change, served_app, settle, watch_changes
from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import prompt_tokens
from kvviz.engine.session import compare, encode_prompt
from kvviz.runtime.models import LoadedModel


def upload_prompt_text(loaded: LoadedModel, tokens: int) -> str:
    """Hamlet (or kvviz's filler) cut so the chat-wrapped prompt is about ``tokens`` tokens, ending with a question."""
    question = "\n\nIn one sentence, what happens in the passage above?"
    body = prompt_tokens(loaded, tokens)
    return loaded.tokenizer.decode(body[: max(8, tokens - 40)], skip_special_tokens=True) + question


@dataclass(frozen=True)
class BrowserRun:
    """One press of Run on Compare: seconds from the click until the results appear and until the page's last
    element is drawn, and the server's CPU seconds over that rerun."""

    shown: float
    drawn: float
    server_cpu: float


def _compare_in_browser(page, url: str, upload: Path, prompt_tokens: int, timeout: float,
                        served: ServedApp) -> BrowserRun:
    """Open Compare from a shared URL, upload the prompt, press Run, and time it (:class:`BrowserRun`)."""
    page.goto(url, timeout=timeout * 1000)
    page.get_by_role("button", name="Run comparison").wait_for(timeout=timeout * 1000)
    settle(page, timeout)
    page.locator('[data-testid="stFileUploader"] input[type="file"]').first.set_input_files(str(upload))
    page.get_by_text(f"Using **{upload.name}**".replace("**", "")).first.wait_for(timeout=timeout * 1000)
    settle(page, timeout)
    cpu, started = served.cpu_seconds(), watch_changes(page)
    page.get_by_role("button", name="Run comparison").click()
    page.get_by_text(f" on {prompt_tokens} prompt tokens").wait_for(timeout=timeout * 1000)
    shown = (page.evaluate("() => performance.now()") - started) / 1000
    drawn = last_change(page, started, timeout=timeout)
    server_cpu = served.cpu_seconds() - cpu
    settle(page, timeout)
    return BrowserRun(shown, drawn, server_cpu)


# A step's run is on screen once its closing text is: the "Notice:" box (steps 1-5) or the closing caption (step 6).
LESSON_DONE = ("Notice:", "The pass key is")


def _lesson_in_browser(page, base: str, step: int, timeout: float) -> float:
    """Open a lesson step, press its run button; seconds from the click until the step's closing text is shown.

    Waits for the button itself rather than for the page to settle: a warm server renders the page after the running
    indicator was checked, so a settle-then-look finds no button."""
    page.goto(f"{base}/Lessons?step={step}", timeout=timeout * 1000)
    button = page.locator('[data-testid="stBaseButton-primary"]').first
    button.wait_for(timeout=timeout * 1000)
    started = time.perf_counter()
    button.click()
    done = page.locator('[data-testid="stException"]')
    for text in LESSON_DONE:
        done = done.or_(page.get_by_text(text))
    done.first.wait_for(timeout=timeout * 1000)
    seconds = time.perf_counter() - started
    if page.locator('[data-testid="stException"]').count():
        raise RuntimeError(f"lesson step {step} raised: {page.inner_text('body')[:300]}")
    settle(page, timeout)
    return seconds


def lesson_steps(base: str, page, timeout: float) -> int:
    """How many steps the Lessons page offers (the options of its step radio), 0 when no radio shows up in time."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{base}/Lessons", timeout=timeout * 1000)
    radios = page.locator('[data-testid="stRadio"]').first.get_by_role("radio")
    try:
        radios.first.wait_for(state="attached", timeout=timeout * 1000)
    except PlaywrightTimeout:
        return 0
    return radios.count()


def _time_lessons(section: Section, browser, base: str, timeout: float, log) -> None:
    """Every lesson step cold (its run computed) and warm (the stored result, from a new session), each a figure;
    a step that fails or times out is a failing figure, and finding no steps at all is one too."""
    from playwright.sync_api import Error as PlaywrightError

    steps = lesson_steps(base, browser.new_page(), min(timeout, 300))
    section.add("lesson_steps", steps, target=">= 1", note="" if steps else "no step radio on the Lessons page")
    for step in range(1, steps + 1):
        log(f"  lesson step {step}: cold, then warm")
        try:
            cold = _lesson_in_browser(browser.new_page(), base, step, timeout)
            warm = _lesson_in_browser(browser.new_page(), base, step, timeout)
        except (PlaywrightError, RuntimeError) as error:
            section.add(f"lesson_{step}_ran", False, target="== True", note=str(error).splitlines()[0][:200])
            continue
        section.add(f"lesson_{step}_cold", cold, "s", note="the step's run computed")
        section.add(f"lesson_{step}_warm", warm, "s", "<= 2", note="the stored result, from a new session")


@bench_section("app")
def app(run: BenchRun) -> Section:
    """Served app vs engine on the issue's comparison, cached re-render, lessons cold/warm."""
    loaded, sizes, log = run.loaded, run.sizes, run.log
    section = Section("app", "the served app in headless chromium vs its engine")
    chromium = chromium_path()
    if loaded.tokenizer is None or loaded.name.startswith("random:"):
        section.skipped = "needs the model the app serves (a random-weight model has no page)"
        return section
    if chromium is None:
        section.skipped = "chromium is not installed (make browser)"
        return section
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        section.skipped = "the playwright package is not installed"
        return section

    text = upload_prompt_text(loaded, sizes.app_prompt)
    ids = encode_prompt(loaded.tokenizer, text, chat=True)
    specs = list(app_specs(sizes.app_prompt))
    timeout = 1800.0
    engine = []

    def engine_run() -> None:
        started = time.perf_counter()
        compare(loaded, ids, specs, sizes.app_tokens, reuse_prefix=False)
        engine.append(time.perf_counter() - started)

    with tempfile.TemporaryDirectory(prefix="kvviz-bench-app-") as folder:
        work = Path(folder)
        upload = work / "prompt.txt"
        upload.write_text(text, encoding="utf-8")
        query = urllib.parse.urlencode([("m", s) for s in specs] + [("n", sizes.app_tokens), ("chat", 1)])
        env = {"KVVIZ_RESULTS": str(work / "results"), "KVVIZ_MODEL": loaded.name, "KVVIZ_DEVICE": loaded.device}
        log(f"  engine: {len(specs)} configurations, {len(ids)} prompt tokens, {sizes.app_tokens} new tokens")
        engine_run()
        with served_app(work / "server.log", env) as served, sync_playwright() as playwright:
            base = served.url
            browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                log("  app: the same comparison through the Compare page")
                app_seconds = _compare_in_browser(browser.new_page(viewport={"width": 1400, "height": 1000}),
                                                  f"{base}/Compare?{query}", upload, len(ids), timeout, served).shown
                engine_run()  # engine timed before and after the app, so a slow spell hits both sides
                log(f"  app: the stored result, opened from {sizes.app_walks} new sessions")
                cached = [_compare_in_browser(browser.new_page(viewport={"width": 1400, "height": 1000}),
                                              f"{base}/Compare?{query}", upload, len(ids), timeout, served)
                          for _ in range(sizes.app_walks)]
                section.add("app_vs_engine", app_seconds / statistics.mean(engine), "x", "<= 1.15",
                            note=f"app {app_seconds:.1f} s, engine {statistics.mean(engine):.1f} s "
                                 f"({' / '.join(f'{e:.1f}' for e in engine)}); {len(specs)} configurations, "
                                 f"{len(ids)} prompt tokens, {sizes.app_tokens} new tokens; both prefill fresh "
                                 "(the engine's second run would otherwise reuse its first run's prefix) and pad "
                                 "rows alike (compare's running batch)")
                drawn = [walk.drawn for walk in cached]
                section.add("cached_rerender", statistics.median(drawn), "s", "<= 1.5",
                            note=f"median of {sizes.app_walks} new sessions, from the click until the page last "
                                 f"changed ({' / '.join(f'{d:.2f}' for d in drawn)} s)")
                section.add("cached_first_result", statistics.median(w.shown for w in cached), "s", "<= 0.6",
                            note="from the click until the success line shows")
                section.add("cached_rerender_server_seconds", statistics.median(w.server_cpu for w in cached), "s",
                            "<= 0.2", note="the server process's CPU seconds (all threads) over that rerun, median: "
                                           "the script, sending the page, and Streamlit's collection after the "
                                           "script")
                if sizes.lessons:
                    _time_lessons(section, browser, base, timeout, log)
            finally:
                browser.close()
    return section
