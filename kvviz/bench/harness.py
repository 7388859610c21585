"""The benchmark's harness: figures and sections, the report, timing and peak memory, and the section registry.

Each section is a function registered with :func:`bench_section`; :func:`run_bench` runs the chosen ones in the order
they were registered (cheapest first, see ``kvviz.bench.sections``). A section gets a :class:`BenchRun` (the model,
the sizes, a log) and returns a :class:`Section`. Where one section reuses another's measurement, both call a
function wrapped in :func:`shared_measurement`, computed once per run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch

from kvviz.runtime.admission import ALONE
from kvviz.runtime.jobs import Job, Stage, Steps
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.sweep_rounds import DEFAULT_MAX_ITEMS, DEFAULT_SECONDS

Log = Callable[[str], None]
T = TypeVar("T")


@dataclass
class Sizes:
    """How big each measurement is. ``default`` is what the issues ask for on the default model on CPU."""

    compare_prompt: int = 2048
    compare_tokens: int = 16
    generate_prompt: int = 512
    generate_tokens: int = 64
    capture_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    decode_prompt: int = 4096
    decode_budget: int = 512
    decode_steps: int = 16
    bookkeeping_context: int = 2048
    peer_prompt: int = 2048
    ppl_tokens: int = 2048
    needle_lengths: tuple[int, ...] = (512, 1024, 2048)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_tokens: int = 12
    app_prompt: int = 2022  # a 2K upload's comparison (app, classroom): its upload, six configurations
    app_tokens: int = 32
    app_runs: int = 5  # fresh comparisons in the app section, each between two engine runs (after one untimed)
    app_walks: int = 5  # stored-result walks in the app section, each from a new browser session
    lessons: bool = True  # time every lesson step (the app and classroom sections)
    class_students: int = 4  # the classroom section's class of 2K uploads, served both ways (each ~20 s on the CPU)
    batched_prompt: int = 2048
    batched_tokens: int = 32
    repeats: int = 2
    prefix_preamble: int = 1536
    prefix_question: int = 30
    sweep_items: int = 32  # the trade-off sweep: the default families on task items and on a play
    sweep_task_length: int = 512
    sweep_sample_items: int = 2  # items every SPEC also runs on as its own comparison (extrapolated to all)
    sweep_sample_specs: int = 0  # SPECs evenly spaced that run alone on those items (0: every SPEC)
    sweep_play_tokens: int = 512
    sweep_ray_items: int = 8  # the sweep on one local Ray worker against the same sweep in process
    sweep_ray_task_length: int = 256
    # the Trade-offs default run, adaptive: the page's cap, time budget and items' length
    adaptive_max_items: int = DEFAULT_MAX_ITEMS
    adaptive_seconds: float = DEFAULT_SECONDS
    adaptive_task_length: int = 256
    adaptive_fixed_items: int = 32  # the fixed design of earlier rounds, run beside it
    adaptive_repeats: int = 3  # the time budget makes each repeat's items differ: a median of three paired ratios


SIZES: dict[str, Sizes] = {
    "default": Sizes(),
    "quick": Sizes(compare_prompt=96, compare_tokens=3, generate_prompt=32, generate_tokens=4,
                   capture_lengths=(64, 128), decode_prompt=96, decode_budget=32, decode_steps=2,
                   bookkeeping_context=64, peer_prompt=160, ppl_tokens=16, needle_lengths=(120,),
                   needle_depths=(0.5,), needle_tokens=3, batched_prompt=96, batched_tokens=4, app_prompt=64,
                   app_tokens=2, app_runs=1, app_walks=1, lessons=False, class_students=6, prefix_preamble=96,
                   prefix_question=8, repeats=1,
                   sweep_items=2, sweep_task_length=160, sweep_sample_items=1, sweep_sample_specs=4,
                   sweep_play_tokens=24, sweep_ray_items=2, sweep_ray_task_length=160, adaptive_max_items=8,
                   adaptive_seconds=60.0, adaptive_task_length=160, adaptive_fixed_items=4, adaptive_repeats=1),
    "gpu": Sizes(compare_prompt=4096, compare_tokens=32, generate_prompt=4096, generate_tokens=128,
                 capture_lengths=(4096, 8192, 16384, 32768), decode_prompt=32768, decode_budget=1024,
                 decode_steps=32, bookkeeping_context=8192, peer_prompt=16384, ppl_tokens=2048, repeats=3),
}


def with_lengths(sizes: Sizes, lengths: tuple[int, ...]) -> Sizes:
    """Sizes with the capture lengths replaced (``--lengths``), e.g. 4K..32K on a GPU."""
    return replace(sizes, capture_lengths=lengths)


@dataclass
class Figure:
    """One measured number; ``target`` like ``<= 0.5`` and ``passed`` when the figure has a target."""

    name: str
    value: float | int | bool | str | None
    unit: str = ""
    target: str = ""
    passed: bool | None = None
    note: str = ""


@dataclass
class Section:
    name: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None  # why the section did not run (a method or module it needs is missing)

    def add(self, name: str, value, unit: str = "", target: str = "", note: str = "") -> Figure:
        figure = Figure(name, _round(value), unit, target, _check(value, target), note)
        self.figures.append(figure)
        return figure


@dataclass
class BenchReport:
    command: str
    preset: str
    model: str
    machine: dict
    sections: list[Section] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def failed(self) -> list[str]:
        return [f"{s.name}.{f.name}" for s in self.sections for f in s.figures if f.passed is False]

    def table(self) -> str:
        """A markdown table of every figure (docs/performance.md's tables are pasted from it)."""
        lines = ["| section | figure | value | target | pass |", "|---|---|---|---|---|"]
        for section in self.sections:
            if section.skipped:
                lines.append(f"| {section.name} | skipped | {section.skipped} | | |")
                continue
            for f in section.figures:
                mark = "" if f.passed is None else ("yes" if f.passed else "**no**")
                value = f"{f.value} {f.unit}".strip()
                lines.append(f"| {section.name} | {f.name} | {value} | {f.target} | {mark} |")
        return "\n".join(lines)


def _round(value):
    if isinstance(value, float) and math.isfinite(value):
        return round(value, 4 if abs(value) < 100 else 1)
    return value


def _check(value, target: str) -> bool | None:
    """``target`` is ``<= x``, ``>= x``, ``< x`` or ``== x`` (``== True`` for checks)."""
    if not target or value is None:
        return None
    op, bound = target.split(" ", 1)
    if op == "==":
        return str(value) == bound
    bound_value = float(bound)
    return {"<=": value <= bound_value, ">=": value >= bound_value, "<": value < bound_value}[op]


# -- timing and memory ------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, work: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``work`` took (the device synchronised on both ends) and what it returned."""
    sync(device)
    started = time.perf_counter()
    result = work()
    sync(device)
    return time.perf_counter() - started, result


@dataclass
class Spread:
    """Repeated timings of one variant: the median is the figure, the range says how noisy the machine was."""

    seconds: list[float]

    @property
    def median(self) -> float:
        ordered = sorted(self.seconds)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def note(self) -> str:
        runs = len(self.seconds)
        return (f"median of {runs} runs, {min(self.seconds):.2f}-{max(self.seconds):.2f} s" if runs > 1
                else "1 run")


def interleaved(device: str, variants: dict[str, Callable[[], T]], repeats: int,
                log: Log | None = None) -> dict[str, tuple[Spread, T]]:
    """Each variant ``repeats`` times, in turns (A B A B ...), so a slow spell of a shared machine hits every
    variant alike; per variant its timings and its last result."""
    timings: dict[str, list[float]] = {name: [] for name in variants}
    results: dict[str, T] = {}
    for _ in range(max(1, repeats)):
        for name, work in variants.items():
            seconds, results[name] = timed(device, work)
            timings[name].append(seconds)
            if log is not None:
                log(f"    {name}: {seconds:.2f} s (load {os.getloadavg()[0]:.2f})")
    return {name: (Spread(timings[name]), results[name]) for name in variants}


class PeakMemory:
    """Peak extra memory during a block: CUDA's allocator statistics; on Linux the kernel's peak-RSS counter
    (reset on entry, so nothing runs beside the work); elsewhere RSS sampled every few ms by a thread."""

    def __init__(self, device: str):
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._process = psutil.Process()
        self._base = self._process.memory_info().rss
        self._thread = None
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss - self._base)

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            status = Path("/proc/self/status").read_text().splitlines()
            high_water = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
            self.peak = max(0, high_water - self._base)


@contextlib.contextmanager
def threads(count: int | None):
    """Run with ``count`` torch threads (1 is steadier than 2 on a CPU shared with other jobs)."""
    if not count:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- sections ---------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class BenchRun:
    """What every section of one run gets: the model, the sizes and a log; measurements two sections share are kept
    here for the run's length only (see :func:`shared_measurement`)."""

    loaded: LoadedModel
    sizes: Sizes
    log: Log
    _shared: dict[Callable, object] = field(default_factory=dict, repr=False)


def shared_measurement(measure: Callable[[BenchRun], T]) -> Callable[[BenchRun], T]:
    """A measurement more than one section uses: computed on first call in a run, the same object after that. The
    sections that need it call it, so the dependency is in the code, and either may run alone."""

    @functools.wraps(measure)
    def once(run: BenchRun) -> T:
        if measure not in run._shared:
            run._shared[measure] = measure(run)
        return run._shared[measure]

    return once


Runner = Callable[[BenchRun], Section]
RUNNERS: dict[str, Runner] = {}  # in registration order, which is the order sections run in
CLIENTS: set[str] = set()  # sections that act as the engine's clients (a class's runs, a served app)


def bench_section(name: str, client: bool = False) -> Callable[[Runner], Runner]:
    """Register a section's function under ``name`` (the name in ``--sections`` and in the report). A section runs
    as one job on the model's engine, holding the model for its whole length, so kvviz's paths and their baselines
    compute on the same thread, the engine's (:mod:`kvviz.runtime.engine`); a ``client`` section instead submits
    runs as the app's users do, and the engine serves them."""

    def register(runner: Runner) -> Runner:
        if name in RUNNERS:
            raise ValueError(f"bench section {name!r} is registered twice")
        RUNNERS[name] = runner
        if client:
            CLIENTS.add(name)
        return runner

    return register


def machine_info(loaded: LoadedModel) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": loaded.device,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if loaded.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(loaded.device)
    return info


def run_bench(loaded: LoadedModel, preset: str = "default", sections: Iterable[str] | None = None,
              command: str = "", log: Log | None = None, sizes: Sizes | None = None,
              on_section: Callable[[BenchReport], None] | None = None) -> BenchReport:
    """Run the chosen sections (all by default) in the registry's order; a section that raises is reported as
    skipped with its error."""
    chosen = set(RUNNERS if sections is None else sections)
    unknown = sorted(chosen - RUNNERS.keys())
    if unknown:
        raise ValueError(f"unknown bench section(s) {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
    run = BenchRun(loaded, sizes or SIZES[preset], log or (lambda message: None))
    report = BenchReport(command=command, preset=preset, model=loaded.name, machine=machine_info(loaded))
    started = time.perf_counter()
    for name in (name for name in RUNNERS if name in chosen):
        run.log(f"[{name}]")
        section_started, load_before = time.perf_counter(), _load_average()
        try:
            runner = RUNNERS[name]
            section = runner(run) if name in CLIENTS else loaded.engine.run(
                Job(functools.partial(_section_steps, runner, run), ALONE, name))
        except (RuntimeError, ValueError, ImportError, AttributeError, TypeError, KeyError) as error:
            section = Section(name, name, skipped=f"failed: {type(error).__name__}: {error}")
        section.seconds = round(time.perf_counter() - section_started, 2)
        _add_load(section, load_before, _load_average())
        report.sections.append(section)
        report.seconds = round(time.perf_counter() - started, 2)
        if on_section is not None:
            on_section(report)
    return report


def _section_steps(runner: Runner, run: BenchRun, progress: Progress) -> Steps[Section]:
    """A section as one step of a job: the model its own while it times kvviz's paths and their baselines."""
    yield Stage.MEASURE
    return runner(run)


def _load_average() -> float | None:
    """The 1-minute load average, where the system reports one."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _add_load(section: Section, before: float | None, after: float | None) -> None:
    """Say how busy the machine was: timings taken beside other work (a load above 1) are not an idle machine's."""
    if before is None or after is None or section.skipped:
        return
    busy = max(before, after) > 1
    section.add("load_average", max(before, after), note=f"1-minute load {before:.2f} at the start, {after:.2f} at "
                f"the end" + ("; above 1: the timings shared the CPU with other work" if busy else ""))
