"""A class on one server: every lesson step and a student's runs timed through the engine on this device, and the
wait a class of 30 would see here, projected from those per-run times (:mod:`kvviz.planning.classroom`).

No browser: the requests are the ones the pages run (``kvviz.lessons.step_requests``, Compare's
``CompareRequest``), so the section runs wherever the model does, a GPU included (``scripts/gpu_check.sh`` runs it
on a random-weight model of SmolLM2's shape with the real tokenizer). On the CPU, ``tests/test_load.py`` measures
the first projection's class through real Streamlit sessions.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import NamedTuple

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved, timed
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.engine.session import encode_prompt
from kvviz.lessons import step_requests
from kvviz.planning.classroom import ClassRun, ClassWait, percentile, project_class
from kvviz.runs import CompareRequest, RunRequest
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.together import RUNS_TOGETHER

STUDENTS = 30
LESSON_STUDENTS = 5  # as in the load test: five students on Lessons step 1 share one run, the others compare
STUDENT_SPECS = ("full", "window:window=12")  # the load test's short comparison
STUDENT_PROMPTS = ("Name two planets.", "Name three rivers.", "Name four birds.")
STUDENT_TOKENS = 3
CLASS_TOPICS = ("planets", "rivers", "birds", "colours", "tools", "trees", "metals", "dances", "breads", "boats")


def _seconds(loaded: LoadedModel, requests: tuple[RunRequest, ...]) -> float:
    """Wall seconds of the requests' computations, one after another, as a cold page runs them."""
    return sum(timed(loaded.device, lambda r=request: r.compute(loaded))[0] for request in requests)


def _student_request(loaded: LoadedModel, prompt: str) -> CompareRequest:
    ids = (encode_prompt(loaded.tokenizer, prompt, chat=True) if loaded.tokenizer is not None
           else prompt_tokens(loaded, 32))
    return CompareRequest(tuple(ids), STUDENT_SPECS, STUDENT_TOKENS)


def serve_class(loaded: LoadedModel, requests: list[RunRequest], together: int) -> list[float]:
    """Every request submitted at once and served as the app's queue serves a class: ``together`` runs at a time
    in submission order (1: one at a time), comparisons among them decoding in one batch. Returns each request's
    seconds from the submission until its result."""
    slots, ready = threading.Semaphore(together), threading.Event()
    until_result = [0.0] * len(requests)

    def serve(index: int) -> None:
        ready.wait()
        time.sleep(0.001 * index)  # submission order: the semaphore serves its waiters in the order they came
        with slots:
            requests[index].compute(loaded)
        until_result[index] = time.perf_counter() - started

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    ready.set()
    for thread in threads:
        thread.join()
    return until_result


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


def _add_served(section: Section, name: str, loaded: LoadedModel, requests: list[RunRequest], what: str,
                log, repeats: int = 1) -> None:
    """The class served one run at a time and with runs decoding together, in turns (the same requests, results
    already stored nowhere: every request computes), ``repeats`` times each; how much sooner everybody is done, and
    where the time went: decode steps are what runs share (and prefills of prompts nobody records), so their share
    of the time one at a time and how much shorter they got together say what the ratio can be on this device."""
    decoder, prefills = loaded.decoder, loaded.prefills

    def counters() -> ServedCounters:
        return ServedCounters(decoder.shared_forwards, prefills.shared_forwards, decoder.seconds)

    done: dict[int, list[list[float]]] = {1: [], RUNS_TOGETHER: []}
    totals = {together: ServedCounters() for together in done}  # gained while served, over the repeats
    for _ in range(max(1, repeats)):  # interleaved, so a slow spell of the machine hits both ways
        for together in done:
            before = counters()
            log(f"  {what}: {len(requests)} runs, {together} at a time")
            done[together].append(serve_class(loaded, requests, together))
            totals[together] = totals[together].plus(counters(), before)
    all_done = {together: statistics.median(max(times) for times in served) for together, served in done.items()}
    for together, served in done.items():
        label = "one_at_a_time" if together == 1 else "together"
        waits = [statistics.median(run) for run in zip(*served, strict=True)]  # each student's median wait
        section.add(f"{name}_{label}_p50", percentile(waits, 0.5), "s",
                    note=f"{what}, {together} run(s) admitted at a time: seconds until a student's result")
        section.add(f"{name}_{label}_p95", percentile(waits, 0.95), "s")
        spread = " / ".join(f"{max(times):.1f}" for times in served)
        section.add(f"{name}_{label}_all_done", all_done[together], "s",
                    note=f"median of {len(served)} ({spread} s); over them, {totals[together].merged_steps} decode "
                         f"and {totals[together].merged_prefills} prefill forwards fed more than one run")
    ratio = all_done[RUNS_TOGETHER] / all_done[1]
    section.add(f"{name}_together_vs_one_at_a_time", ratio, "x", "<= 0.6" if loaded.device == "cpu" else "",
                note=f"all done, {RUNS_TOGETHER} runs decoding together against one at a time")
    served_seconds = sum(max(times) for times in done[1])
    decoding_alone, decoding_together = totals[1].decode_seconds, totals[RUNS_TOGETHER].decode_seconds
    decode_share = decoding_alone / served_seconds
    decode_ratio = decoding_together / max(1e-9, decoding_alone)
    section.add(f"{name}_decode_share", decode_share, "",
                note="of the time one at a time, the share in decode steps (the rest: prefills, forks, diagnosis and "
                     "scoring, paid per run, except prefills of prompts nobody records, which share forwards)")
    section.add(f"{name}_decode_together_vs_apart", decode_ratio, "x",
                note=f"decode steps' seconds with runs decoding together over one at a time; with the rest as it "
                     f"was, all done would be {1 - decode_share * (1 - decode_ratio):.2f}x")
    log(f"  {what}: all done in {all_done[RUNS_TOGETHER]:.1f} s together, {all_done[1]:.1f} s one at a time "
        f"({ratio:.2f}x); decode steps {decode_share:.0%} of the time alone, {decode_ratio:.2f}x together")


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
    section.add(f"{name}_wait_p50", wait.wait_p50, "s", note=f"{what}: {wait.runs} runs for {wait.students} students")
    section.add(f"{name}_wait_p95", wait.wait_p95, "s")
    section.add(f"{name}_all_done", wait.done, "s", note="until the last student has a result")


@bench_section("classroom")
def classroom(run: BenchRun) -> Section:
    """Lesson steps cold, a student's short comparison and the issue's comparison per run; class-of-30 waits."""
    loaded, sizes, log = run.loaded, run.sizes, run.log
    section = Section("classroom", "a class of 30 on this device: per-run times and the projected waits")
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
    _add_projection(section, "class_mix", project_class(runs),
                    f"{STUDENTS - LESSON_STUDENTS} short comparisons"
                    + (f" + Lessons step 1 shared by {LESSON_STUDENTS}" if lessons else ""))
    mix = [_student_request(loaded, f"Name {count} {topic}.") for count in ("two", "three", "four")
           for topic in CLASS_TOPICS]
    _add_served(section, "class_mix", loaded, mix, f"{STUDENTS} short comparisons", log, sizes.repeats)

    prompt = fit(loaded, sizes.app_prompt)
    specs = app_specs(prompt)
    log(f"  the issue's comparison: {len(specs)} configurations, {prompt} prompt tokens, {sizes.app_tokens} new")
    seconds = _seconds(loaded, (CompareRequest(tuple(prompt_tokens(loaded, prompt)), specs, sizes.app_tokens),))
    section.add("issue_comparison", seconds, "s", note=f"{len(specs)} configurations, {prompt} prompt tokens")
    _add_projection(section, "class_issue", project_class([ClassRun("issue comparison", seconds)] * STUDENTS),
                    f"every student runs the issue's comparison on their own {prompt}-token upload")
    text = prompt_tokens(loaded, prompt + sizes.class_students)
    uploads = [CompareRequest(tuple(text[i:i + prompt]), specs, sizes.app_tokens)  # no two share a prefix
               for i in range(sizes.class_students)]
    _add_served(section, "class_issue", loaded, uploads, f"{len(uploads)} students' comparisons of {len(specs)} "
                f"configurations on their own {prompt}-token uploads", log)
    rows = 2 * len(specs) - 1  # every configuration and, for those that part from full, a teacher-forced twin
    shared = linear_sharing(loaded, rows, RUNS_TOGETHER, max(3, sizes.repeats))
    section.add("class_issue_linear_together_vs_apart", shared, "x",
                note=f"the linear layers for {RUNS_TOGETHER} runs' {rows} rows in one multiply over {RUNS_TOGETHER} "
                     f"multiplies apart ({1 / RUNS_TOGETHER:.3f}x if reading the weights were all they cost): the "
                     "part of a decode step a batch shares; the rest of a step is per row")
    log(f"  linear layers of {RUNS_TOGETHER} runs' rows together: {shared:.2f}x of apart")
    return section
