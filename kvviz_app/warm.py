"""Class warm-up: open every page with its defaults, press its run buttons (every lesson step's too) and leave the
results in the result store (:mod:`kvviz.runs`), so the first student gets each one without waiting.

    python -m kvviz_app.warm [--pages Compare,Lessons] [--timeout 3600]      (make warm; the container runs it)

Pages run in-process through Streamlit's AppTest, exactly as a browser session would run them, so what is stored is
what the pages will ask for. Prints how long each took.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamlit.logger import set_log_level
from streamlit.testing.v1 import AppTest

from kvviz.comparison.startup import start_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "views"
STEP_RADIO = "step"  # a page with a radio under this key (Lessons) is warmed step by step


@dataclass
class WarmRun:
    """One page (and step) opened with its defaults and its run buttons pressed."""

    page: str
    step: str
    seconds: float
    buttons: int
    error: str | None = None


def page_name(script: Path) -> str:
    """``views/2_Compare.py`` -> ``Compare`` (the name the navigation shows)."""
    return script.stem.split("_", 1)[-1].replace("_", " ")


def _problem(app: AppTest) -> str | None:
    if app.exception:
        return str(app.exception[0].value)[:300]
    if app.error:
        return str(app.error[0].value)[:300]
    return None


def _press_run_buttons(app: AppTest, limit: int = 8) -> int:
    """Click each enabled primary button once, in page order (a run may reveal another); how many were pressed."""
    pressed: set[str] = set()
    for _ in range(limit):
        button = next((b for b in app.button if b.proto.type == "primary" and not b.disabled
                       and (b.key or b.label) not in pressed), None)
        if button is None or _problem(app):
            break
        pressed.add(button.key or button.label)
        button.click().run()
    return len(pressed)


def warm_page(script: Path, timeout: float) -> list[WarmRun]:
    """Every step of one page, each run from a fresh session as a student would open it."""
    app = AppTest.from_file(str(script), default_timeout=timeout).run()
    steps = [None]
    radios = [r for r in app.radio if r.key == STEP_RADIO]
    if radios:
        steps = list(radios[0].options)
    runs = []
    for step in steps:
        started = time.perf_counter()
        app = AppTest.from_file(str(script), default_timeout=timeout).run()
        if step is not None:
            app.radio(key=STEP_RADIO).set_value(step).run()
        buttons = _press_run_buttons(app) if not _problem(app) else 0
        runs.append(WarmRun(page_name(script), step or "", time.perf_counter() - started, buttons, _problem(app)))
    return runs


def warm(pages: list[str] | None = None, timeout: float = 3600,
         report: Callable[[WarmRun], None] | None = None) -> list[WarmRun]:
    """Warm ``pages`` (names as the navigation shows them; all by default)."""
    scripts = sorted(PAGES.glob("*.py"))
    unknown = set(pages or ()) - {page_name(s) for s in scripts}
    if unknown:
        raise ValueError(f"unknown page(s) {', '.join(sorted(unknown))}; pages: "
                         f"{', '.join(page_name(s) for s in scripts)}")
    runs = []
    for script in scripts:
        if pages and page_name(script) not in pages:
            continue
        for run in warm_page(script, timeout):
            runs.append(run)
            if report is not None:
                report(run)
    return runs


def _print(run: WarmRun) -> None:
    where = f"{run.page} · {run.step}" if run.step else run.page
    status = f"FAILED: {run.error}" if run.error else f"{run.buttons} run(s)"
    print(f"{where:<48} {run.seconds:8.1f} s  {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvviz_app.warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", help="comma-separated page names (default: every page)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one page may take")
    args = parser.parse_args(argv)
    set_log_level("error")  # pages run outside a server: Streamlit would warn about it on every call
    start_server()  # the pages' settings, applied as app.py's start-up applies them
    pages = [p.strip() for p in args.pages.split(",")] if args.pages else None
    started = time.perf_counter()
    try:
        runs = warm(pages, args.timeout, _print)
    except ValueError as error:
        print(f"warm: {error}", file=sys.stderr)
        return 2
    failed = [r for r in runs if r.error]
    print(f"warmed {len(runs) - len(failed)} of {len(runs)} in {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
