"""The engine on a thread of this process, as kvviz runs it, against the same engine in a process of its own, the
alternative an engine could take (docs/architecture.md says which was chosen and why, from these figures).

Both sides run the app's comparison (its upload's length, six configurations, fresh prefills) from this process's
main thread as a client: the thread side hands it to the model's engine here; the process side sends it down a pipe
to a spawned process that loaded the same model and runs it there on that process's own engine, and the result
comes back pickled, which is what a process of its own adds to every run. The two sides take turns, so a slow spell
of the machine hits both; the result's pickled size, its copy time alone and the second process's resident memory
are reported beside them.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from multiprocessing.connection import Connection

from kvviz.bench.browser import resident_bytes
from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import prompt_tokens
from kvviz.engine.results import Comparison
from kvviz.engine.session import compare

Work = tuple[list[int], list[str], int]  # prompt ids, configurations, new tokens: one comparison


def serve_comparisons(name: str, device: str, dtype: str, weights: str, pipe: Connection) -> None:
    """The process side: load the model, say ready with this process's resident bytes, then run every comparison
    that arrives on the model's engine and send its result back, until ``None`` arrives."""
    from kvviz.runtime.models import load_model

    loaded = load_model(name, device=device, dtype=dtype, weights=weights)
    pipe.send(resident_bytes(os.getpid()))
    while (work := pipe.recv()) is not None:
        ids, specs, new_tokens = work
        pipe.send(compare(loaded, ids, specs, new_tokens, reuse_prefix=False))
    pipe.send(resident_bytes(os.getpid()))


def _copy_seconds(result: Comparison, repeats: int = 5) -> tuple[int, float]:
    """The result's pickled size and the best time to pickle and unpickle it (a pipe's copy, without the pipe)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        best = min(best, time.perf_counter() - started)
    return len(data), best


@bench_section("engine_process", client=True)
def engine_process(run: BenchRun) -> Section:
    """The app's comparison on the engine's thread here vs on an engine in a process of its own."""
    loaded, sizes, log = run.loaded, run.sizes, run.log
    section = Section("engine_process", "the engine on a thread of the server vs in a process of its own")
    if loaded.name.startswith("random:"):
        section.skipped = "needs a model a second process can load by name (a random-weight model has none)"
        return section
    ids = prompt_tokens(loaded, sizes.app_prompt)
    work: Work = (ids, list(app_specs(sizes.app_prompt)), sizes.app_tokens)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter, as a server would start its engine
    here, there = context.Pipe()
    process = context.Process(target=serve_comparisons, daemon=True,
                              args=(loaded.name, loaded.device, str(loaded.dtype).removeprefix("torch."),
                                    loaded.weights, there))
    started = time.perf_counter()
    process.start()
    try:
        ready_rss = here.recv()
        start_seconds = time.perf_counter() - started
        log(f"  a second process loaded {loaded.name} in {start_seconds:.1f} s; {len(work[1])} configurations, "
            f"{len(ids)} prompt tokens, {work[2]} new, thread and process in turns")

        def in_a_process() -> Comparison:
            here.send(work)
            return here.recv()

        timings = interleaved(loaded.device, {
            "thread": lambda: compare(loaded, *work, reuse_prefix=False),
            "process": in_a_process}, max(2, sizes.repeats), log)
        here.send(None)
        final_rss = here.recv()
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    (thread_time, thread_result), (process_time, process_result) = timings["thread"], timings["process"]
    size, copy_seconds = _copy_seconds(process_result)
    section.add("thread_seconds", thread_time.median, "s", note=thread_time.note())
    section.add("process_seconds", process_time.median, "s", note=f"{process_time.note()}; the pipe's round trip "
                "and the result's copy included")
    section.add("process_vs_thread", process_time.median / thread_time.median, "x",
                note="medians; above 1: a process of its own costs the run more than it saves")
    section.add("result_megabytes", size / 1e6, "MB", note="one comparison's result, pickled (what a pipe carries)")
    section.add("result_copy_seconds", copy_seconds, "s", note="best of 5: pickle and unpickle, without the pipe")
    section.add("process_start_seconds", start_seconds, "s", note="spawning the process and loading the model")
    section.add("process_resident_gb", max(ready_rss, final_rss) / 1e9, "GB",
                note=f"the second process's resident memory: {ready_rss / 1e9:.2f} GB loaded, {final_rss / 1e9:.2f} "
                     "GB after the runs (torch, the model and its heap, held beside the server's own)")
    section.add("same_tokens", [r.token_ids for r in thread_result.results]
                == [r.token_ids for r in process_result.results], target="== True",
                note="both sides compute the same comparison")
    return section
