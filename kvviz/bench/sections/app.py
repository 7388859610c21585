"""The served app timed against its own engine, in headless chromium.

What a student feels: the app is started as a plain ``streamlit run app.py`` (its own process, the baked config, an
empty result store; ``make run`` adds only flags, and the section says the command line), Compare is driven through
the real page (URL settings, file upload, the Run button) and timed from the click until the results are on screen;
the same comparison is timed in this process with the engine alone.
The server's first comparison is reported on its own; then several passages of the play, each timed through the page
between two engine runs on the same machine (their median ratio), the same result opened again from new browser
sessions (cached), and every lesson step cold and warm. "Results shown" is the page's clock at the DOM change that drew
the success line, found without polling the page (:func:`~kvviz.bench.browser.text_shown`): the browser shares the
server's cores here, and the engine's runs have no browser working beside them. As many passages again, interleaved,
run in a second chromium at the idle scheduling class, which only gets cores the model leaves free, as a student's
browser on their own machine: ``app_vs_engine_browser_idle``, reported beside ``app_vs_engine``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import statistics
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvviz.bench import dom
from kvviz.bench.browser import (
    CHROMIUM_ARGS,
    ServedApp,
    browser_cpu_seconds,
    chromium_path,
    last_change,
    process_times,
    resident_bytes,
    served_app,
    settle,
    text_shown,
    watch_changes,
)
from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import prompt_tokens
from kvviz.comparison.session import compare, encode_prompt
from kvviz.runtime.models import LoadedModel

if TYPE_CHECKING:
    from collections.abc import Callable

    from playwright.sync_api import Browser, BrowserContext

VIEWPORT = {"width": 1400, "height": 1000}  # a laptop's browser window


def upload_prompt_text(loaded: LoadedModel, tokens: int, passage: int = 0) -> str:
    """Hamlet (or kvviz's filler) cut so the chat-wrapped prompt is about ``tokens`` tokens, ending with a question;
    ``passage`` k is the k-th such stretch of the play, so no two passages share a prefix the server could reuse."""
    question = "\n\nIn one sentence, what happens in the passage above?"
    length = max(8, tokens - 40)
    body = prompt_tokens(loaded, length * (passage + 1))[length * passage:]
    return loaded.tokenizer.decode(body, skip_special_tokens=True) + question


@dataclass(frozen=True)
class BrowserRun:
    """One press of Run on Compare: seconds from the click until the results appear and until the page's last
    element is drawn, the server's and the browser's CPU seconds over that rerun, the prefill seconds the page
    reports, and the kernel's CPU seconds for the server over the rerun (mostly page faults)."""

    shown: float
    drawn: float
    server_cpu: float
    prefill: float
    browser_cpu: float
    server_kernel: float


def _compare_in_browser(page, url: str, upload: Path, prompt_tokens: int, timeout: float,
                        served: ServedApp) -> BrowserRun:
    """Open Compare from a shared URL, upload the prompt, press Run, and time it (:class:`BrowserRun`)."""
    page.goto(url, timeout=timeout * 1000)
    page.get_by_role("button", name="Run comparison").wait_for(timeout=timeout * 1000)
    settle(page, timeout)
    page.locator(dom.FILE_INPUT).first.set_input_files(str(upload))
    page.get_by_text(f"Using **{upload.name}**".replace("**", "")).first.wait_for(timeout=timeout * 1000)
    settle(page, timeout)
    cpu, kernel, browser_cpu = served.cpu_seconds(), served.kernel_seconds(), browser_cpu_seconds()
    started = watch_changes(page)
    page.get_by_role("button", name="Run comparison").click()
    success_text = f" on {prompt_tokens} prompt tokens"
    shown = (text_shown(page, success_text, timeout) - started) / 1000
    success = page.get_by_text(success_text)
    prefill = float(re.search(r"prefill ([0-9.]+) s", success.inner_text()).group(1))
    drawn = last_change(page, started, timeout=timeout)
    server_cpu, browser_cpu = served.cpu_seconds() - cpu, browser_cpu_seconds() - browser_cpu
    server_kernel = served.kernel_seconds() - kernel
    settle(page, timeout)
    return BrowserRun(shown, drawn, server_cpu, prefill, browser_cpu, server_kernel)


class EngineRun(NamedTuple):
    """One comparison through the engine in the bench's process: its seconds, its prefill's, and the kernel's CPU
    seconds for the process meanwhile (mostly page faults)."""

    seconds: float
    prefill: float
    kernel: float


class AgainstEngine(NamedTuple):
    """Served comparisons against the engine's runs of the same passage just before and after each: each ratio,
    whole and prefill only, and the seconds of both sides listed for a figure's note: the whole runs', and the
    kernel's CPU seconds for each side (on a virtual machine, memory fresh from the kernel can cost a run several
    seconds of page zeroing, on either side)."""

    ratios: list[float]
    prefill_ratios: list[float]
    listed: str
    kernel: str


def _against_engine(served: list[BrowserRun], engine_around: list[tuple[EngineRun, EngineRun]]) -> AgainstEngine:
    around = [statistics.mean(run.seconds for run in pair) for pair in engine_around]
    prefill_around = [statistics.mean(run.prefill for run in pair) for pair in engine_around]
    kernel_around = [statistics.mean(run.kernel for run in pair) for pair in engine_around]
    return AgainstEngine([run.shown / seconds for run, seconds in zip(served, around, strict=True)],
                         [run.prefill / seconds for run, seconds in zip(served, prefill_around, strict=True)],
                         "; ".join(f"app {run.shown:.1f} s / engine {seconds:.1f} s"
                                   for run, seconds in zip(served, around, strict=True)),
                         "; ".join(f"app {run.server_kernel:.1f} s / engine {seconds:.1f} s"
                                   for run, seconds in zip(served, kernel_around, strict=True)))


def _add_app_vs_engine(section: Section, served: list[BrowserRun], engine_around: list[tuple[EngineRun, EngineRun]],
                       engine_first: EngineRun, app_first: BrowserRun, prompt: int, specs: list[str],
                       new_tokens: int) -> None:
    """Each served comparison against the engine's runs of the same request (passage) just before and after it, the
    median of those ratios; and the server's first comparison against the engine's first."""
    ratios, prefill_ratios, listed, kernel = _against_engine(served, engine_around)
    what = (f"{len(specs)} configurations, {prompt} prompt tokens, {new_tokens} new tokens; both prefill fresh and "
            "pad rows alike (compare's running batch)")
    section.add("app_vs_engine", statistics.median(ratios), "x", "<= 1.15",
                note=f"median of {len(served)} passages, each from the click until its results show against the "
                     f"engine's runs of the same passage just before and after it, on a server that has run once: "
                     f"{listed}; {what}")
    section.add("app_prefill_vs_engine", statistics.median(prefill_ratios), "x",
                note="the prefill each page reports against the engine's around it ("
                     + ", ".join(f"{r:.2f}x" for r in prefill_ratios) + "); chromium, on the same cores, used "
                     + " / ".join(f"{run.browser_cpu:.1f}" for run in served) + " CPU s over the app's runs; "
                     f"the kernel's CPU for each side (mostly page faults): {kernel}")
    section.add("app_vs_engine_first_run", app_first.shown / engine_first.seconds, "x",
                note=f"the served app's first comparison, in its new process ({app_first.shown:.1f} s, prefill "
                     f"{app_first.prefill:.2f} s), against the engine's first in this section "
                     f"({engine_first.seconds:.1f} s, prefill {engine_first.prefill:.2f} s)")


def _add_browser_elsewhere(section: Section, served: list[BrowserRun],
                           engine_around: list[tuple[EngineRun, EngineRun]]) -> None:
    """The same measure with the browser at the scheduler's idle class: what a student's browser on their own
    machine leaves the server (reported beside ``app_vs_engine``, whose browser competes for the server's cores)."""
    ratios, prefill_ratios, listed, kernel = _against_engine(served, engine_around)
    section.add("app_vs_engine_browser_idle", statistics.median(ratios), "x",
                note=f"median of {len(served)} further passages, interleaved with app_vs_engine's, timed the same way "
                     "in a second chromium started at the idle scheduling class (chrt --idle 0), which runs only on a "
                     f"core the model leaves free, as a browser on another machine would: {listed}; prefill "
                     + ", ".join(f"{r:.2f}x" for r in prefill_ratios) + "; chromium used "
                     + " / ".join(f"{run.browser_cpu:.1f}" for run in served) + f" CPU s; the kernel's CPU: {kernel}")


def idle_class_chromium(chromium: str, folder: Path) -> str | None:
    """An executable in ``folder`` that starts ``chromium`` at the idle scheduling class (util-linux's ``chrt``; any
    user may lower its own class), or None where there is no ``chrt``."""
    chrt = shutil.which("chrt")
    if chrt is None:
        return None
    launcher = folder / "chromium-idle-class"
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(chrt)} --idle 0 {shlex.quote(chromium)} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def _add_cached(section: Section, first_visits: list[BrowserRun], returns: list[BrowserRun]) -> None:
    """The stored result opened again: drawn, from browsers that never opened kvviz (each fetches the page's scripts
    while it draws); the server's CPU for the rerun, from a browser that has (and, apart, for a first visit)."""
    def listed(values: list[float]) -> str:
        return " / ".join(f"{value:.2f}" for value in values)

    drawn = [walk.drawn for walk in first_visits]
    section.add("cached_rerender", statistics.median(drawn), "s", "<= 1.5",
                note=f"median of {len(drawn)} new sessions, each in a browser that never opened kvviz, from the "
                     f"click until the page last changed ({listed(drawn)} s); in a browser that has: "
                     f"{listed([walk.drawn for walk in returns])} s")
    section.add("cached_first_result", statistics.median(w.shown for w in first_visits), "s", "<= 0.6",
                note="from the click until the success line shows, in a browser that never opened kvviz")
    section.add("cached_rerender_server_seconds", statistics.median(w.server_cpu for w in returns), "s", "<= 0.2",
                note=f"the server process's CPU seconds (all threads) over the rerun, median of {len(returns)} new "
                     f"sessions in a browser that has opened kvviz before ({listed([w.server_cpu for w in returns])}"
                     " s): the script, sending the page, and Streamlit's collection after the script")
    first_cpu = [w.server_cpu for w in first_visits]
    section.add("cached_rerender_server_seconds_first_visit", statistics.median(first_cpu), "s",
                note=f"the same in browsers that never opened kvviz ({listed(first_cpu)} s): besides the rerun, the "
                     "server sends each such browser the scripts the result's table, buttons and controls need "
                     "(about 30 files, once per browser: they are served immutable)")


# A step's run is on screen once its closing text is: the "Notice:" box (steps 1-5) or the closing caption (step 6).
LESSON_DONE = ("Notice:", "The pass key is")


def _lesson_in_browser(page, base: str, step: int, timeout: float) -> float:
    """Open a lesson step, press its run button; seconds from the click until the step's closing text is shown.

    Waits for the button itself rather than for the page to settle: a warm server renders the page after the running
    indicator was checked, so a settle-then-look finds no button."""
    page.goto(f"{base}/Lessons?step={step}", timeout=timeout * 1000)
    button = page.locator(dom.PRIMARY_BUTTON).first
    button.wait_for(timeout=timeout * 1000)
    started = time.perf_counter()
    button.click()
    done = page.locator(dom.EXCEPTION)
    for text in LESSON_DONE:
        done = done.or_(page.get_by_text(text))
    done.first.wait_for(timeout=timeout * 1000)
    seconds = time.perf_counter() - started
    if page.locator(dom.EXCEPTION).count():
        raise RuntimeError(f"lesson step {step} raised: {page.inner_text('body')[:300]}")
    settle(page, timeout)
    return seconds


def lesson_steps(base: str, page, timeout: float) -> int:
    """How many steps the Lessons page offers (the options of its step radio), 0 when no radio shows up in time."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{base}/Lessons", timeout=timeout * 1000)
    radios = page.locator(dom.RADIO).first.get_by_role("radio")
    try:
        radios.first.wait_for(state="attached", timeout=timeout * 1000)
    except PlaywrightTimeout:
        return 0
    return radios.count()


def _time_lessons(section: Section, browser, base: str, timeout: float, log,
                  resident_gb: Callable[[], float]) -> list[float]:
    """Every lesson step cold (its run computed) and warm (the stored result, from a new session), each a figure;
    a step that fails or times out is a failing figure, and finding no steps at all is one too. Returns the server's
    resident gigabytes after each step (a step may load another model: the architecture step loads both)."""
    from playwright.sync_api import Error as PlaywrightError

    steps = lesson_steps(base, browser.new_page(), min(timeout, 300))
    section.add("lesson_steps", steps, target=">= 1", note="" if steps else "no step radio on the Lessons page")
    resident = []
    for step in range(1, steps + 1):
        log(f"  lesson step {step}: cold, then warm")
        try:
            cold = _lesson_in_browser(browser.new_page(), base, step, timeout)
            warm = _lesson_in_browser(browser.new_page(), base, step, timeout)
        except (PlaywrightError, RuntimeError) as error:
            section.add(f"lesson_{step}_ran", False, target="== True", note=str(error).splitlines()[0][:200])
            continue
        finally:
            resident.append(resident_gb())
        section.add(f"lesson_{step}_cold", cold, "s", note="the step's run computed")
        section.add(f"lesson_{step}_warm", warm, "s", "<= 2", note="the stored result, from a new session")
    return resident


@bench_section("app", client=True)
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

    passages = [upload_prompt_text(loaded, sizes.app_prompt, k) for k in range(2 * sizes.app_runs + 1)]
    prompts = [encode_prompt(loaded.tokenizer, text, chat=True) for text in passages]
    specs = list(app_specs(sizes.app_prompt))
    timeout = 1800.0

    def engine_run(passage: int) -> EngineRun:
        """The passage's comparison through the engine in this process, prefilled fresh like the server's."""
        kernel, started = process_times(os.getpid()).system, time.perf_counter()
        prefill = compare(loaded, prompts[passage], specs, sizes.app_tokens, reuse_prefix=False).prefill_seconds
        return EngineRun(time.perf_counter() - started, prefill, process_times(os.getpid()).system - kernel)

    with tempfile.TemporaryDirectory(prefix="kvviz-bench-app-") as folder:
        work = Path(folder)
        uploads = [work / f"passage-{k}.txt" for k in range(len(passages))]
        for upload, text in zip(uploads, passages, strict=True):
            upload.write_text(text, encoding="utf-8")
        query = urllib.parse.urlencode([("m", s) for s in specs] + [("n", sizes.app_tokens), ("chat", 1)])
        env = {"KVVIZ_RESULTS": str(work / "results"), "KVVIZ_MODEL": loaded.name, "KVVIZ_DEVICE": loaded.device}
        log(f"  engine: {len(specs)} configurations, {len(prompts[0])} prompt tokens, {sizes.app_tokens} new tokens")
        engine_first = engine_run(0)
        with served_app(work / "server.log", env) as served, sync_playwright() as playwright:
            section.add("server_started_plain", True, target="== True",
                        note=f"the server was started as `{served.command}`: a plain streamlit run, no environment of "
                             "its own (the settings name the bench's model and an empty result store)")
            browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            idle_launcher = idle_class_chromium(chromium, work)
            idle_browser = None if idle_launcher is None else playwright.chromium.launch(
                executable_path=idle_launcher, headless=True, args=CHROMIUM_ARGS)

            def app_run(passage: int, returning: BrowserContext | None = None,
                        in_browser: Browser | None = None) -> BrowserRun:
                """One student's visit: a new tab, closed afterwards (a class's other tabs are on other machines), in
                a browser that has never opened kvviz (``in_browser``, by default the one at the server's priority),
                or in ``returning``, one that has (its cache holds the page's scripts: served "immutable", fetched
                once per browser)."""
                page = (returning or (in_browser or browser).new_context(viewport=VIEWPORT)).new_page()
                try:
                    return _compare_in_browser(page, f"{served.url}/Compare?{query}", uploads[passage],
                                               len(prompts[passage]), timeout, served)
                finally:
                    page.close()
                    if returning is None:
                        page.context.close()

            try:
                log("  app: the same comparison through the Compare page, the server's first run")
                app_first = app_run(0)
                log(f"  app against engine: {sizes.app_runs} passage(s) of the play, each between two engine runs"
                    + ("" if idle_browser is None else ", and as many in a browser at the idle scheduling class"))
                browsers = {"server": browser} | ({} if idle_browser is None else {"idle": idle_browser})
                served_runs = {name: [] for name in browsers}
                engine_around = {name: [] for name in browsers}
                order = [name for round_ in range(sizes.app_runs)  # ABBA: neither browser always goes first
                         for name in (list(browsers) if round_ % 2 == 0 else list(browsers)[::-1])]
                for passage, name in enumerate(order, start=1):  # a slow spell of the machine hits both sides
                    before = engine_run(passage)
                    served_runs[name].append(app_run(passage, in_browser=browsers[name]))
                    engine_around[name].append((before, engine_run(passage)))
                _add_app_vs_engine(section, served_runs["server"], engine_around["server"], engine_first, app_first,
                                   len(prompts[0]), specs, sizes.app_tokens)
                if idle_browser is not None:
                    _add_browser_elsewhere(section, served_runs["idle"], engine_around["idle"])
                log(f"  app: the stored result, opened from {sizes.app_walks} new session(s) in new browsers, then "
                    "in a browser that has opened it before")
                first_visits = [app_run(1) for _ in range(sizes.app_walks)]
                returning = browser.new_context(viewport=VIEWPORT)
                app_run(1, returning)  # its first visit fills its cache
                returns = [app_run(1, returning) for _ in range(sizes.app_walks)]
                returning.close()
                _add_cached(section, first_visits, returns)

                def resident_gb() -> float:
                    return resident_bytes(served.pid) / 1e9

                before_lessons = resident_gb()
                after_steps = (_time_lessons(section, browser, served.url, timeout, log, resident_gb)
                               if sizes.lessons else [])
                steps = ", ".join(f"{gb:.2f}" for gb in after_steps)
                section.add("server_resident_gb", resident_gb(), "GB",
                            note=f"the server's resident memory after {1 + 2 * sizes.app_runs} comparisons, the "
                                 "cached visits and the lessons (the models, torch, Streamlit and the heap they keep); "
                                 f"{before_lessons:.2f} before the lessons"
                                 + (f", after each step {steps}" if steps else ""))
            finally:
                browser.close()
                if idle_browser is not None:
                    idle_browser.close()
    return section
