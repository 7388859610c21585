"""On a small CPU the engine's small kernels run on one thread (kvviz.runtime.threads): decode steps and forks, not
prefills; the row-invariance probe checks its row counts under both thread counts."""

import pytest
import torch

import kvviz.runtime.engine as engine_module
import kvviz.runtime.invariance as invariance
from kvviz.bench.harness import threads as torch_threads
from kvviz.cache.kvcache import KVCache
from kvviz.comparison.session import compare
from kvviz.runtime.threads import SMALL_CPU_THREADS, small_work, small_work_threads


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
