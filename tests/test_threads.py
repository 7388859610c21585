"""The engine's OpenMP pool kept the only one (kvviz.runtime.threads): a model loads on a thread that exits and takes
its pool with it; on a small CPU the engine's small kernels run on one thread (decode steps and forks, not
prefills); the row-invariance probe checks its row counts under both thread counts; a sweep's rounds are scored on
a thread that exits."""

import os
import threading
import time

import pytest
import torch

import kvviz.runtime.engine as engine_module
import kvviz.runtime.invariance as invariance
import kvviz.runtime.models as models
from kvviz.bench.harness import threads as torch_threads
from kvviz.cache.kvcache import KVCache
from kvviz.comparison.session import compare
from kvviz.runtime.threads import SMALL_CPU_THREADS, on_passing_thread, small_work, small_work_threads
from kvviz.studies.sweep_measure import measure_rows
from kvviz.studies.workloads import TaskWorkload


def test_small_work_runs_on_one_thread_on_a_small_cpu_and_gives_the_count_back():
    with torch_threads(SMALL_CPU_THREADS):
        with small_work("cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == SMALL_CPU_THREADS
        with pytest.raises(RuntimeError), small_work("cpu"):
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == SMALL_CPU_THREADS


def test_small_work_leaves_larger_cpus_and_accelerators_alone():
    with torch_threads(SMALL_CPU_THREADS + 2):
        assert small_work_threads("cpu") is None
        with small_work("cpu"):
            assert torch.get_num_threads() == SMALL_CPU_THREADS + 2
    with torch_threads(SMALL_CPU_THREADS):
        assert small_work_threads("cuda:0") is None and small_work_threads("cpu") == 1


def test_the_engine_decodes_and_forks_on_one_thread_and_prefills_on_every_thread(tiny_model, story_ids, monkeypatch):
    seen: dict[str, set[int]] = {"step": set(), "fork": set(), "prefill": set()}
    step, fork, prefill = engine_module.step_groups, KVCache.fork.__func__, engine_module.prefill_together

    def recording(name, function):
        def record(*args, **kwargs):
            seen[name].add(torch.get_num_threads())
            return function(*args, **kwargs)
        return record

    monkeypatch.setattr(engine_module, "step_groups", recording("step", step))
    monkeypatch.setattr(engine_module, "prefill_together", recording("prefill", prefill))
    monkeypatch.setattr(KVCache, "fork", classmethod(recording("fork", fork)))
    with torch_threads(SMALL_CPU_THREADS):
        compare(tiny_model, story_ids[:40], ["full", "kivi:bits=4,residual=0"], 4, reuse_prefix=False)
    assert seen == {"step": {1}, "fork": {1}, "prefill": {SMALL_CPU_THREADS}}


def test_the_invariance_probe_keeps_the_row_counts_that_agree_under_both_thread_counts(monkeypatch):
    """A matrix multiply's last bits may change with its thread count: a count that agrees on every thread but not on
    one is not padded to."""
    probed: list[int] = []

    def probe(linears):
        probed.append(torch.get_num_threads())
        return (8, 16, 24) if torch.get_num_threads() == 1 else (4, 16, 24)

    monkeypatch.setattr(invariance, "agreeing_row_counts", probe)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch_threads(SMALL_CPU_THREADS):
        assert invariance.install_row_invariance(model, "cpu") == (16, 24)
    assert probed == [SMALL_CPU_THREADS, 1]
    assert type(model[0]) is invariance.RowPaddedLinear and model[0].row_counts == (16, 24)


def _threads_alive() -> int:
    return len(os.listdir("/proc/self/task"))


def test_passing_thread_work_hands_back_its_result_and_its_error_and_leaves_no_thread():
    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return 41 + 1

    assert on_passing_thread(work) == 42
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    with pytest.raises(KeyError, match="no such model"):
        on_passing_thread(lambda: {}["no such model"])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_openmp_pool_of_parallel_work_on_a_passing_thread_goes_with_it():
    """What the load relies on: a pool lives as long as the thread that started it."""
    with torch_threads(2):
        before = _threads_settled()  # in the whole suite, threads other tests left may still be ending
        during = on_passing_thread(lambda: (torch.ones(1_000_000).add_(1), _threads_alive())[1])
        deadline = time.monotonic() + 5
        while _threads_alive() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert during > before + 1  # the passing thread and its pool's helper
        assert _threads_alive() == before


def test_load_model_computes_on_a_passing_thread(monkeypatch):
    seen: list[threading.Thread] = []
    monkeypatch.setattr(models, "_load", lambda *args: seen.append(threading.current_thread()) or "loaded")
    assert models.load_model("any", "cpu") == "loaded"
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def _threads_settled() -> int:
    """The thread count once it has held still for a while: threads that just finished are gone (5 s at most)."""
    count, since, deadline = _threads_alive(), time.monotonic(), time.monotonic() + 5
    while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        if _threads_alive() != count:
            count, since = _threads_alive(), time.monotonic()
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_sweep_round_is_scored_on_a_passing_thread_and_leaves_its_caller_no_openmp_pool(real_model):
    """A sweep's caller lives on through every round; a pool of its own would slow the next round's prefill."""
    workload, specs = TaskWorkload("multikey", 256, 1), ["full", "streaming_llm:window=28"]
    counts: list[int] = []

    def caller() -> None:
        counts.append(_threads_settled())
        measure_rows(real_model, workload, specs, [0])
        counts.append(_threads_settled())

    with torch_threads(2):
        measure_rows(real_model, workload, specs, [0])  # the engine and its pool are up
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join()
    assert counts[1] == counts[0], "the caller started no pool of its own"
