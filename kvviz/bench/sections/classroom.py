"""A class on one server: every lesson step and a student's runs timed through the engine on this device, the wait a
class of 30 would see here one run at a time, projected from those per-run times (:mod:`kvviz.planning.classroom`),
and two classes served for real, one run at a time and as the server admits runs together
(:mod:`kvviz.runtime.admission`): 30 short comparisons, and a few students each comparing six configurations on
their own 2K-token upload (``--class-students``). Both ways are submitted to the model's engine
(:class:`~kvviz.runtime.engine.Engine`, which the app's pages submit to) as the pages' jobs (the running batch, its
rows padded as the app pads them), so neither side is favoured.

No browser: the requests are the ones the pages run (``kvviz.lessons.step_requests``, Compare's
``CompareRequest``), so the section runs wherever the model does, a GPU included (``scripts/gpu_check.sh`` runs it
on a random-weight model of SmolLM2's shape with the real tokenizer). On the CPU, ``tests/test_load.py`` measures
the first projection's class through real Streamlit sessions.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import NamedTuple

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved, timed
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.comparison.session import encode_prompt
from kvviz.lessons import step_requests
from kvviz.planning.classroom import ClassRun, ClassWait, percentile, project_class
from kvviz.runs import CompareRequest, RunRequest
from kvviz.runtime.admission import ADMISSION, ONE_AT_A_TIME, RUNS_TOGETHER, Admission
from kvviz.runtime.jobs import Handle, Status
from kvviz.runtime.models import LoadedModel

STUDENTS = 30
LESSON_STUDENTS = 5  # as in the load test: five students on Lessons step 1 share one run, the others compare
STUDENT_SPECS = ("full", "window:window=12")  # the load test's short comparison
STUDENT_PROMPTS = ("Name two planets.", "Name three rivers.", "Name four birds.")
STUDENT_TOKENS = 3
CLASS_TOPICS = ("planets", "rivers", "birds", "colours", "tools", "trees", "metals", "dances", "breads", "boats")


def _seconds(loaded: LoadedModel, requests: tuple[RunRequest, ...]) -> float:
    """Wall seconds of the requests' computations, one after another, as a cold page runs them."""
    return sum(timed(loaded.device, lambda r=request: r.run(loaded))[0] for request in requests)


def _student_request(loaded: LoadedModel, prompt: str) -> CompareRequest:
    ids = (encode_prompt(loaded.tokenizer, prompt, chat=True) if loaded.tokenizer is not None
           else prompt_tokens(loaded, 32))
    return CompareRequest(tuple(ids), STUDENT_SPECS, STUDENT_TOKENS)


def serve_class(loaded: LoadedModel, requests: list[RunRequest], admission: Admission) -> tuple[list[float], int]:
    """Every request's job submitted at once to the model's engine (one student each, so its round-robin is the
    order of submission), under ``admission`` for the class's length (the engine's own policy back after), each run
    admitted beside the runs in progress as the policy says, comparisons among them decoding in one batch. Returns
    each request's seconds from the submission until its result, and the most runs that were in progress at once."""
    engine = loaded.engine
    jobs = [request.job(loaded) for request in requests]
    policy, engine.admission = engine.admission, admission
    try:
        started = time.monotonic()  # the clock handles keep
        handles = engine.submit_all(jobs, [f"student-{index}" for index in range(len(jobs))])
        for handle in handles:
            handle.wait()
            if handle.status is not Status.DONE:
                raise RuntimeError(f"a student's run did not finish: {handle.error or handle.status.value}")
    finally:
        engine.admission = policy
    return [handle.finished_at - started for handle in handles], most_at_once(handles)


def most_at_once(handles: list[Handle]) -> int:
    """The most runs in progress at the same moment, from each run's admission and finish."""
    events = sorted([(handle.started_at, 1) for handle in handles] + [(handle.finished_at, -1) for handle in handles],
                    key=lambda event: (event[0], event[1]))
    return max(itertools.accumulate(change for _, change in events), default=0)


class ServedCounters(NamedTuple):
    """What the model's running batch and shared prefill counted: forwards that fed more than one run, and the
    seconds spent in decode steps."""

    merged_steps: int = 0
    merged_prefills: int = 0
    decode_seconds: float = 0.0

    def plus(self, now: ServedCounters, before: ServedCounters) -> ServedCounters:
        """These counts with what was gained between ``before`` and ``now`` added."""
        return ServedCounters(*(total + later - earlier
                                for total, later, earlier in zip(self, now, before, strict=True)))


WAYS = {"one_at_a_time": ONE_AT_A_TIME, "together": ADMISSION}  # how a class is served, and what it is compared with


def add_served_class(section: Section, name: str, loaded: LoadedModel, requests: list[RunRequest], what: str,
                log, repeats: int = 1, all_done_target: str = "") -> None:
    """The class served one run at a time and as the server's admission policy admits runs together, in turns (the
    same requests, results stored nowhere: every request computes), ``repeats`` times each, the order of the two
    ways swapped each time; each student's wait (the median over the repeats) and when everybody is done, both
    ways, and where the time went: decode steps are what runs share (and prefills of prompts nobody records), so
    their share of the time one at a time and how much shorter they got together say what the ratio can be on this
    device."""
    engine = loaded.engine

    def counters() -> ServedCounters:
        return ServedCounters(engine.shared_forwards, engine.shared_prefills, engine.seconds)

    sizes = [job.size for job in (request.job(loaded) for request in requests)]
    alone = not any(ADMISSION.admits([first], second) for first in sizes for second in sizes)
    served_ways = ["one_at_a_time"] if alone else list(WAYS)  # alone: the server's way is one at a time, the
    # same schedule, so serving it twice would only measure the machine's noise
    done: dict[str, list[list[float]]] = {way: [] for way in WAYS}
    most_at_once = dict.fromkeys(WAYS, 0)
    totals = {way: ServedCounters() for way in WAYS}  # gained while served, over the repeats
    for repeat in range(max(1, repeats)):  # interleaved, so a slow spell of the machine hits both ways
        for way in (served_ways if repeat % 2 == 0 else list(reversed(served_ways))):
            before = counters()
            log(f"  {what}: {len(requests)} runs, {WAYS[way].describe(loaded.device)}")
            until_result, at_once = serve_class(loaded, requests, WAYS[way])
            done[way].append(until_result)
            most_at_once[way] = max(most_at_once[way], at_once)
            totals[way] = totals[way].plus(counters(), before)
    if alone:
        done["together"], totals["together"] = done["one_at_a_time"], totals["one_at_a_time"]
        most_at_once["together"] = most_at_once["one_at_a_time"]
        log(f"  {what}: the server starts each of these runs alone ({ADMISSION.describe(loaded.device)}), as one "
            "at a time: served that way only")
    waits = {way: [statistics.median(run) for run in zip(*served, strict=True)] for way, served in done.items()}
    all_done = {way: statistics.median(max(times) for times in served) for way, served in done.items()}
    for way, served in done.items():
        same = (f"; the server starts each of these runs alone (at {sizes[0].positions:,} positions), so this is "
                "the one-at-a-time schedule and its runs") if alone and way == "together" else ""
        section.add(f"{name}_{way}_wait_p50", percentile(waits[way], 0.5), "s",
                    note=f"{what}, {WAYS[way].describe(loaded.device)} (at most {most_at_once[way]} at once here): "
                         f"seconds until a student's result, each student's median over the repeats{same}")
        section.add(f"{name}_{way}_wait_p95", percentile(waits[way], 0.95), "s")
        spread = " / ".join(f"{max(times):.1f}" for times in served)
        section.add(f"{name}_{way}_all_done", all_done[way], "s",
                    note=f"median of {len(served)} ({spread} s); over them, {totals[way].merged_steps} decode "
                         f"and {totals[way].merged_prefills} prefill forwards fed more than one run")
    ratio = all_done["together"] / all_done["one_at_a_time"]
    why = (f" (1 by construction: the policy starts each of these runs alone, {sizes[0].positions:,} positions > "
           f"{ADMISSION.bound(loaded.device) or 0:,})") if alone else ""
    section.add(f"{name}_together_vs_one_at_a_time", ratio, "x", all_done_target,
                note=f"all done, {what}: as the server admits runs together against one at a time{why}")
    for share, label in ((0.5, "p50"), (0.95, "p95")):
        section.add(f"{name}_wait_{label}_together_vs_one_at_a_time",
                    percentile(waits["together"], share) / percentile(waits["one_at_a_time"], share), "x", "<= 1.0",
                    note=f"the {label} student's wait, as the server admits runs together against one at a time{why}")
    served_seconds = sum(max(times) for times in done["one_at_a_time"])
    decoding_alone, decoding_together = totals["one_at_a_time"].decode_seconds, totals["together"].decode_seconds
    decode_share = decoding_alone / served_seconds
    decode_ratio = decoding_together / max(1e-9, decoding_alone)
    section.add(f"{name}_decode_share", decode_share, "",
                note="of the time one at a time, the share in decode steps (the rest: prefills, forks, diagnosis and "
                     "scoring, paid per run, except prefills of prompts nobody records, which share forwards)")
    section.add(f"{name}_decode_together_vs_apart", decode_ratio, "x",
                note=f"decode steps' seconds with runs admitted together over one at a time; with the rest as it "
                     f"was, all done would be {1 - decode_share * (1 - decode_ratio):.2f}x")
    log(f"  {what}: all done in {all_done['together']:.1f} s together, {all_done['one_at_a_time']:.1f} s one at a "
        f"time ({ratio:.2f}x); median wait {percentile(waits['together'], 0.5):.1f} s against "
        f"{percentile(waits['one_at_a_time'], 0.5):.1f} s; decode steps {decode_share:.0%} of the time alone, "
        f"{decode_ratio:.2f}x together")


def linear_sharing(loaded: LoadedModel, rows: int, runs: int, repeats: int) -> float:
    """The model's linear layers, the part of a decode step whose weights every row shares, for ``runs`` runs'
    ``rows`` rows each in one multiply over ``runs`` multiplies apart (medians, in turns): 1/runs if reading the weights
    were all they cost, 1 if their arithmetic were. What decoding together can save at most, per step, on this
    device."""
    linears = [module for module in loaded.model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = {width: torch.randn(rows * runs, 1, width, dtype=loaded.dtype, device=loaded.device)
              for width in {linear.in_features for linear in linears}}

    def multiply(count: int, times: int) -> None:
        with torch.inference_mode():
            for _ in range(times):
                for linear in linears:
                    linear(inputs[linear.in_features][:count])

    timings = interleaved(loaded.device, {"apart": lambda: multiply(rows, runs),
                                          "together": lambda: multiply(rows * runs, 1)}, repeats)
    return timings["together"][0].median / timings["apart"][0].median


def _add_projection(section: Section, name: str, wait: ClassWait, what: str) -> None:
    section.add(f"{name}_projected_wait_p50", wait.wait_p50, "s",
                note=f"{what}, one at a time, projected from per-run times: {wait.runs} runs for {wait.students} "
                     "students")
    section.add(f"{name}_projected_wait_p95", wait.wait_p95, "s")
    section.add(f"{name}_projected_all_done", wait.done, "s", note="until the last student has a result")


@bench_section("classroom", client=True)
def classroom(run: BenchRun) -> Section:
    """Lesson steps cold, a student's short comparison and a 2K upload's comparison per run; class-of-30 waits
    projected; both classes served one at a time and as the server admits runs together."""
    loaded, sizes, log = run.loaded, run.sizes, run.log
    section = Section("classroom", "a class on this device: per-run times, projected waits, and two classes served")
    _seconds(loaded, (_student_request(loaded, STUDENT_PROMPTS[0]),))  # warm-up: a server has run before
    lessons: list[float] = []
    if loaded.tokenizer is None:
        section.add("lesson_steps", 0, note="needs a tokenizer (--tokenizer DIR with --random-model)")
    elif sizes.lessons:
        for number, (key, requests) in enumerate(step_requests(loaded).items(), 1):
            log(f"  lesson step {number} ({key}), cold")
            lessons.append(_seconds(loaded, requests))
            section.add(f"lesson_{number}_cold", lessons[-1], "s", note=f"{key}: {len(requests)} engine run(s)")

    log(f"  a student's comparison ({', '.join(STUDENT_SPECS)}, {STUDENT_TOKENS} tokens)")
    student = statistics.median(_seconds(loaded, (_student_request(loaded, p),)) for p in STUDENT_PROMPTS)
    section.add("student_comparison", student, "s", note=f"median of {len(STUDENT_PROMPTS)} prompts")
    runs = [ClassRun("student comparison", student) for _ in range(STUDENTS - LESSON_STUDENTS)]
    if lessons:
        runs.insert(0, ClassRun("lesson step 1", lessons[0], LESSON_STUDENTS))
    _add_projection(section, "short", project_class(runs),
                    f"{STUDENTS - LESSON_STUDENTS} short comparisons"
                    + (f" + Lessons step 1 shared by {LESSON_STUDENTS}" if lessons else ""))
    short = [_student_request(loaded, f"Name {count} {topic}.") for count in ("two", "three", "four")
             for topic in CLASS_TOPICS]
    add_served_class(section, "short", loaded, short, f"{STUDENTS} short comparisons", log, sizes.repeats,
                "<= 0.6" if loaded.device == "cpu" else "")

    prompt = fit(loaded, sizes.app_prompt)
    specs = app_specs(prompt)
    log(f"  a 2K upload's comparison: {len(specs)} configurations, {prompt} prompt tokens, {sizes.app_tokens} new")
    seconds = _seconds(loaded, (CompareRequest(tuple(prompt_tokens(loaded, prompt)), specs, sizes.app_tokens),))
    section.add("upload_comparison", seconds, "s", note=f"{len(specs)} configurations, {prompt} prompt tokens")
    _add_projection(section, "upload", project_class([ClassRun("upload comparison", seconds)] * STUDENTS),
                    f"{STUDENTS} students each comparing {len(specs)} configurations on their own {prompt}-token "
                    "upload")
    text = prompt_tokens(loaded, prompt + sizes.class_students)
    uploads = [CompareRequest(tuple(text[i:i + prompt]), specs, sizes.app_tokens)  # no two share a prefix
               for i in range(sizes.class_students)]
    add_served_class(section, "upload", loaded, uploads, f"a class of {len(uploads)} students each comparing "
                f"{len(specs)} configurations on their own {prompt}-token upload", log, sizes.repeats)
    rows = 2 * len(specs) - 1  # every configuration and, for those that part from full, a teacher-forced twin
    shared = linear_sharing(loaded, rows, RUNS_TOGETHER, max(3, sizes.repeats))
    section.add("upload_linear_together_vs_apart", shared, "x",
                note=f"the linear layers for {RUNS_TOGETHER} runs' {rows} rows in one multiply over {RUNS_TOGETHER} "
                     f"multiplies apart ({1 / RUNS_TOGETHER:.3f}x if reading the weights were all they cost): the "
                     "part of a decode step a batch shares; the rest of a step is per row")
    log(f"  linear layers of {RUNS_TOGETHER} runs' rows together: {shared:.2f}x of apart")
    return section
