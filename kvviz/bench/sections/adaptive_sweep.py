"""The Trade-offs page's default run, adaptive against fixed: how many points each design decides per minute, and how
many items the run scores per second.

The adaptive run is the page's default (its families and budgets on multikey items of ``adaptive_task_length``
tokens, rounds of 16 items up to ``adaptive_max_items``, no new round past ``adaptive_seconds``). Its baseline is the
fixed design that gathers the same evidence: one look at every item the adaptive run gave full, every point on every
one of them (the same seed, so the same items). The fixed ``adaptive_fixed_items``-item design of earlier rounds runs
beside them, so the report says how many points it decides too. The three run in turns, ``adaptive_repeats`` times,
each on a fresh measurement (no stored rounds).

The ratio is paired by repeat: the time budget ends the adaptive run, so how many items it reaches depends on how fast
the machine ran during it, and each repeat's fixed baseline runs on that repeat's items. Each repeat gives one ratio
of decided points per minute; the figure is their median, and the note lists every repeat's ratio and items.

At the page's own settings the same run is then timed as its user sees it: the Trade-offs page served by a plain
``streamlit run app.py`` on an empty result store, its defaults untouched, in headless chromium from the click on
"Run the sweep" until the page's last element is drawn; the points it decided are read from the stored result.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from kvviz.bench.browser import CHROMIUM_ARGS, chromium_path, last_change, served_app, settle, text_shown, watch_changes
from kvviz.bench.harness import BenchRun, Section, Spread, bench_section, timed
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


DESIGNS = ("adaptive", "fixed_same_items", "fixed_items")


@dataclass
class Repeat:
    """One repeat of the three designs, run in turns: each design's seconds and report."""

    seconds: dict[str, float] = field(default_factory=dict)
    reports: dict[str, SweepReport] = field(default_factory=dict)

    def per_minute(self, design: str) -> float:
        return decided(self.reports[design]) / (self.seconds[design] / 60)

    def per_second(self, design: str) -> tuple[float, float]:
        """Items, and (item, configuration) pairs, scored per second."""
        report, seconds = self.reports[design], self.seconds[design]
        return report.rounds.items / seconds, cells(report) / seconds

    def ratio(self) -> float:
        """Decided points per minute, adaptive against the fixed design on this repeat's items (NaN when the fixed
        design decides none: a cap too small for any decision)."""
        fixed = self.per_minute("fixed_same_items")
        return self.per_minute("adaptive") / fixed if fixed else math.nan


def _repeat(loaded: LoadedModel, stream: TaskWorkload, families: list[str], adaptive: Adaptive, fixed_items: int,
            log) -> Repeat:
    """The adaptive run, the fixed design on the items it reached, and the fixed ``fixed_items``-item design."""
    repeat = Repeat()

    def sweep(name: str, workload: TaskWorkload, design: Adaptive | None) -> None:
        seconds, repeat.reports[name] = timed(loaded.device, lambda: run_sweep(
            loaded, workload, families, list(DEFAULT_BUDGETS), adaptive=design))
        repeat.seconds[name] = seconds
        log(f"    {name}: {seconds:.2f} s, {repeat.reports[name].rounds.items} items, "
            f"{decided(repeat.reports[name])} decided (load {os.getloadavg()[0]:.2f})")

    sweep("adaptive", stream, adaptive)
    sweep("fixed_same_items", TaskWorkload(TASK, stream.length, repeat.reports["adaptive"].rounds.items), None)
    sweep("fixed_items", TaskWorkload(TASK, stream.length, fixed_items), None)
    return repeat


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
    repeats: list[Repeat] = []
    for _ in range(max(1, sizes.adaptive_repeats)):
        repeats.append(_repeat(loaded, stream, families, adaptive, sizes.adaptive_fixed_items, run.log))
    last = repeats[-1]
    for name in DESIGNS:
        spread = Spread([repeat.seconds[name] for repeat in repeats])
        report = last.reports[name]
        section.add(f"{name}_seconds", spread.median, "s", note=spread.note())
        section.add(f"{name}_decided_points", decided(report), note=f"of {len(report.points) - 1}; {report.workload}")
        section.add(f"{name}_decided_points_per_minute", median([r.per_minute(name) for r in repeats]), "/min")
        items, pairs = zip(*(r.per_second(name) for r in repeats), strict=True)
        section.add(f"{name}_items_per_second", median(items), "items/s",
                    note=f"{median(pairs):.2f} (item, configuration) pairs per second (medians over the repeats)")
    adaptive_report = last.reports["adaptive"]
    within = [p.spec for p in adaptive_report.points[1:] if p.paired and p.paired.verdict == "within margin"]
    section.add("adaptive_within_points", len(within), note=", ".join(within) or "none proven within the margin")
    section.add("adaptive_ended", adaptive_report.rounds.describe())
    each = "; ".join(f"{r.ratio():.2f}x on {r.reports['adaptive'].rounds.items} items" for r in repeats)
    ratios = [ratio for ratio in (r.ratio() for r in repeats) if math.isfinite(ratio)]
    section.add("decided_points_per_minute", median(ratios) if ratios else math.nan, "x", ">= 2",
                note="adaptive against the fixed design on the same items (decided points per minute), the median "
                     f"of each repeat's ratio: {each}")
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
