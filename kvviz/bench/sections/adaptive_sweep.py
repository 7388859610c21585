"""The Trade-offs page's default run, adaptive against fixed: how many points each design decides per minute, and how
many items the run scores per second.

The adaptive run is the page's default (its families and budgets on multikey items of ``adaptive_task_length``
tokens, rounds of 16 items up to ``adaptive_max_items``, no new round past ``adaptive_seconds``). Its baseline is the
fixed design that gathers the same evidence: one look at every item the adaptive run gave full, every point on every
one of them (the same seed, so the same items). The fixed ``adaptive_fixed_items``-item design of earlier rounds runs
beside them, so the report says how many points it decides too. The three run in turns, ``repeats`` times, each on a
fresh measurement (no stored rounds).

At the page's own settings the same run is then timed as its user sees it: the Trade-offs page served by a plain
``streamlit run app.py`` on an empty result store, its defaults untouched, in headless chromium from the click on
"Run the sweep" until the page's last element is drawn; the points it decided are read from the stored result.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

from kvviz.bench.browser import CHROMIUM_ARGS, chromium_path, last_change, served_app, settle, text_shown, watch_changes
from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved
from kvviz.methods import REGISTRY
from kvviz.runtime.models import LoadedModel
from kvviz.studies.sweep import DEFAULT_BUDGETS, SweepReport, run_sweep
from kvviz.studies.sweep_rounds import DEFAULT_MAX_ITEMS, DEFAULT_SECONDS, Adaptive
from kvviz.studies.workloads import TaskWorkload

FAMILIES = ("streaming_llm", "snapkv", "kivi:residual=0")  # the Trade-offs page's first run
TASK = "multikey"
PAGE_TASK_LENGTH = 256  # the page's default items
VIEWPORT = {"width": 1400, "height": 1000}


def decided(report: SweepReport) -> int:
    """Points whose verdict is not inconclusive."""
    return sum(p.paired is not None and p.paired.verdict != "inconclusive" for p in report.points[1:])


def cells(report: SweepReport) -> int:
    """(item, configuration) pairs the run scored, full's included."""
    return sum(p.items_used or 0 for p in report.points)


@bench_section("adaptive_sweep")
def adaptive_sweep(run: BenchRun) -> Section:
    section = Section("adaptive_sweep", "The Trade-offs default run: adaptive rounds against the fixed design that "
                                        "scores every point on the same items")
    loaded, sizes = run.loaded, run.sizes
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "chat_template", None):
        section.skipped = "needs a real tokenizer with a chat template (task items are chat prompts)"
        return section
    families = [f for f in FAMILIES if f.split(":")[0] in REGISTRY]
    adaptive = Adaptive(sizes.adaptive_max_items, sizes.adaptive_seconds)
    stream = TaskWorkload(TASK, sizes.adaptive_task_length, sizes.adaptive_max_items)
    run.log(f"  {len(families)} families on {TASK} items of {stream.length} tokens: adaptive (up to "
            f"{adaptive.max_items} items, {adaptive.seconds:g} s), the fixed design on its items, and "
            f"{sizes.adaptive_fixed_items} fixed items")
    reports: dict[str, SweepReport] = {}

    def adaptive_run() -> SweepReport:
        reports["adaptive"] = run_sweep(loaded, stream, families, list(DEFAULT_BUDGETS), adaptive=adaptive)
        return reports["adaptive"]

    def same_items() -> SweepReport:
        used = reports["adaptive"].rounds.items
        return run_sweep(loaded, TaskWorkload(TASK, stream.length, used), families, list(DEFAULT_BUDGETS))

    def fixed_items() -> SweepReport:
        return run_sweep(loaded, TaskWorkload(TASK, stream.length, sizes.adaptive_fixed_items), families,
                         list(DEFAULT_BUDGETS))

    timed = interleaved(loaded.device, {"adaptive": adaptive_run, "fixed_same_items": same_items,
                                        "fixed_items": fixed_items}, sizes.repeats, run.log)
    rates = {}
    for name, (spread, report) in timed.items():
        points = len(report.points) - 1
        rates[name] = decided(report) / (spread.median / 60)
        section.add(f"{name}_seconds", spread.median, "s", note=spread.note())
        section.add(f"{name}_decided_points", decided(report), note=f"of {points}; {report.workload}")
        section.add(f"{name}_decided_points_per_minute", rates[name], "/min")
        section.add(f"{name}_items_per_second", report.rounds.items / spread.median, "items/s",
                    note=f"{cells(report) / spread.median:.2f} (item, configuration) pairs per second")
    adaptive_report = timed["adaptive"][1]
    within = [p.spec for p in adaptive_report.points[1:] if p.paired and p.paired.verdict == "within margin"]
    section.add("adaptive_within_points", len(within), note=", ".join(within) or "none proven within the margin")
    section.add("adaptive_ended", adaptive_report.rounds.describe())
    section.add("decided_points_per_minute", rates["adaptive"] / rates["fixed_same_items"], "x", ">= 2",
                note="adaptive against the fixed design on the same items (decided points per minute)")
    page_settings = (sizes.adaptive_max_items, sizes.adaptive_seconds, sizes.adaptive_task_length)
    if page_settings != (DEFAULT_MAX_ITEMS, DEFAULT_SECONDS, PAGE_TASK_LENGTH):
        run.log("  the page's default run is timed at the default sizes only")
    elif chromium_path() is None:
        run.log("  the page's default run needs chromium (make browser)")
    else:
        _add_page_run(section, loaded, run.log)
    return section


def _add_page_run(section: Section, loaded: LoadedModel, log) -> None:
    """The Trade-offs page's default run in headless chromium on an empty result store, click to last element."""
    from playwright.sync_api import sync_playwright

    timeout = 900.0
    log("  the page: Trade-offs' default run in headless chromium, from the click to the last element drawn")
    with tempfile.TemporaryDirectory(prefix="kvviz-bench-tradeoffs-") as folder:
        results = Path(folder) / "results"
        env = {"KVVIZ_RESULTS": str(results), "KVVIZ_MODEL": loaded.name, "KVVIZ_DEVICE": loaded.device}
        with served_app(Path(folder) / "server.log", env) as served, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport=VIEWPORT).new_page()
            page.goto(f"{served.url}/Trade_offs", timeout=timeout * 1000)
            button = page.get_by_role("button", name="Run the sweep")
            button.wait_for(timeout=timeout * 1000)
            settle(page, timeout)
            started = watch_changes(page)
            button.click()
            shown = (text_shown(page, "Items each point used", timeout) - started) / 1000
            drawn = last_change(page, started, timeout=timeout)
            browser.close()
        stored = sorted((results / "sweep").glob("*.pkl"))
        report: SweepReport = pickle.loads(stored[0].read_bytes())  # written by this bench's own server
    points = len(report.points) - 1
    within = [p.spec for p in report.points[1:] if p.paired and p.paired.verdict == "within margin"]
    section.add("page_default_run_seconds", drawn, "s", "<= 180",
                note=f"click to the last element drawn (the results shown at {shown:.1f} s); {served.command}")
    section.add("page_decided_points", decided(report), target=">= 10",
                note=f"of {points}; {report.rounds.describe()}")
    section.add("page_within_points", len(within), target=">= 1",
                note=", ".join(within) or "none proven within the margin")
