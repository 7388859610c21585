"""The engine on a thread of this process, as kvviz runs it, against the same engine in a process of its own, the
alternative an engine could take (docs/architecture.md says which was chosen and why, from these figures).

Both sides run the app's comparison (its upload's length, six configurations, fresh prefills) from this process's
main thread as a client: the thread side hands it to the model's engine here; the process side sends it down a
socket to a new interpreter that loaded the same model and runs it there on that process's own engine, and the result
comes back pickled, which is what a process of its own adds to every run. The two sides take turns, so a slow spell
of the machine hits both; the result's pickled size, its copy time alone and the second process's resident memory
are reported beside them.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

from kvviz.bench.browser import resident_bytes
from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved
from kvviz.bench.specs import app_specs
from kvviz.bench.workloads import prompt_tokens
from kvviz.comparison.results import Comparison
from kvviz.comparison.session import compare

Work = tuple[list[int], list[str], int]  # prompt ids, configurations, new tokens: one comparison


def serve_comparisons(name: str, device: str, dtype: str, weights: str, pipe: Connection) -> None:
    """The process side: load the model, say ready with this process's resident bytes, then run every comparison
    that arrives on the model's engine and send its result back, until ``None`` arrives. A failure is sent back as
    its message, so the bench reports it instead of waiting."""
    from kvviz.runtime.models import load_model

    try:
        loaded = load_model(name, device=device, dtype=dtype, weights=weights)
        send(pipe, resident_bytes(os.getpid()))
        while (work := read(pipe)) is not None:
            ids, specs, new_tokens = work
            send(pipe, compare(loaded, ids, specs, new_tokens, reuse_prefix=False))
        send(pipe, resident_bytes(os.getpid()))
    except Exception as error:  # any failure of the process side ends the section, named
        send(pipe, ProcessFailed(f"{type(error).__name__}: {error}"))


def send(pipe: Connection, message: object) -> None:
    """``message`` pickled plainly, tensors copied into the bytes: multiprocessing's own pickler would hand a tensor
    over as a shared-memory descriptor, which only a child of multiprocessing (sharing its key) may fetch."""
    pipe.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def read(pipe: Connection) -> object:
    """The next message :func:`send` wrote on the other side (EOFError where that side has closed)."""
    return pickle.loads(pipe.recv_bytes())


class ProcessFailed(RuntimeError):
    """The engine's process failed; its message says how."""


def start_process(code: str, *arguments: str) -> tuple[subprocess.Popen, Connection]:
    """A new interpreter running ``code`` (with kvviz importable, and the socket's descriptor as its first argument,
    then ``arguments``) and this side's connection to it. A plain interpreter rather than multiprocessing's spawn:
    spawn re-runs the caller's main module in the child, which under a Streamlit test is the app's script."""
    here, there = socket.socketpair()
    root = str(Path(__file__).resolve().parents[3])
    prologue = f"import sys; sys.path.insert(0, {root!r}); from multiprocessing.connection import Connection; "
    process = subprocess.Popen([sys.executable, "-c", prologue + code, str(there.fileno()), *arguments],
                               pass_fds=(there.fileno(),))
    there.close()  # the child holds its end: if it dies, this side reads the end of the stream, not a hang
    return process, Connection(here.detach())


def start_engine_process(name: str, device: str, dtype: str, weights: str) -> tuple[subprocess.Popen, Connection]:
    """:func:`serve_comparisons` in a process of its own, and the connection to it."""
    code = ("from kvviz.bench.sections.engine_process import serve_comparisons; "
            "serve_comparisons(*sys.argv[2:], Connection(int(sys.argv[1])))")
    return start_process(code, name, device, dtype, weights)


def receive(pipe: Connection, process: subprocess.Popen, timeout: float = 600):
    """The process side's next answer; raises where it failed, exited or said nothing for ``timeout`` seconds (a
    process that died reads as the end of the stream)."""
    if not pipe.poll(timeout):
        raise ProcessFailed(f"the engine's process said nothing for {timeout:.0f} s")
    try:
        answer = read(pipe)
    except EOFError:
        raise ProcessFailed(f"the engine's process exited with code {process.wait(10)} before answering") from None
    if isinstance(answer, ProcessFailed):
        raise answer
    return answer


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
    started = time.perf_counter()  # a fresh interpreter, as a server would start its engine
    process, here = start_engine_process(loaded.name, loaded.device, str(loaded.dtype).removeprefix("torch."),
                                         loaded.weights)
    try:
        ready_rss = receive(here, process)
        start_seconds = time.perf_counter() - started
        log(f"  a second process loaded {loaded.name} in {start_seconds:.1f} s; {len(work[1])} configurations, "
            f"{len(ids)} prompt tokens, {work[2]} new, thread and process in turns")

        def in_a_process() -> Comparison:
            send(here, work)
            return receive(here, process)

        timings = interleaved(loaded.device, {
            "thread": lambda: compare(loaded, *work, reuse_prefix=False),
            "process": in_a_process}, max(2, sizes.repeats), log)
        send(here, None)
        final_rss = receive(here, process)
    finally:
        here.close()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
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
