"""A batched comparison (every configuration in one forward per step) gives what running them one by one gives:
the same tokens, teacher-forced scores, bytes and ledgers, with rows of different lengths side by side and a failing
method leaving the batch alone."""

import pytest
import torch

from kvviz.comparison.batched import decode_prompts
from kvviz.comparison.session import FREE, compare
from kvviz.methods import REGISTRY, budget_spec
from kvviz.methods.h2o import H2O
from kvviz.methods.window import Window
from kvviz.runtime import batch, engine
from kvviz.runtime.prefill import prefill_together
from kvviz.runtime.prefix import shared_prefixes
from kvviz.runtime.replay import Sampling
from kvviz.studies.tail_items import stream_items

EVICTIONS = sorted(name for name, cls in REGISTRY.items() if cls.kind == "eviction")


def assert_same_rows(batched, sequential):
    """Everything a comparison reports per method, batched vs one by one (KL within float tolerance)."""
    assert [r.method for r in batched.results] == [r.method for r in sequential.results]
    for ours, theirs in zip(batched.results, sequential.results, strict=True):
        where = ours.method
        assert ours.error == theirs.error, where
        assert ours.token_ids == theirs.token_ids, where
        assert ours.text == theirs.text, where
        assert ours.kv_bytes == theirs.kv_bytes and ours.kv_bytes_full == theirs.kv_bytes_full, where
        assert ours.kv_breakdown == theirs.kv_breakdown, where
        assert ours.kv_bytes_per_step == theirs.kv_bytes_per_step, where
        assert ours.kv_bytes_per_layer == theirs.kv_bytes_per_layer, where
        assert ours.agreement_with_full == theirs.agreement_with_full, where
        assert ours.first_divergence == theirs.first_divergence, where
        assert ours.kl_per_step == pytest.approx(theirs.kl_per_step, rel=1e-5, abs=1e-5), where  # float32 sums
        assert (ours.ledger is None) == (theirs.ledger is None), where
        if ours.ledger is not None:
            assert torch.equal(ours.ledger.evicted_at, theirs.ledger.evicted_at), where
            assert ours.ledger.to_json(ours.ledger.length) == theirs.ledger.to_json(theirs.ledger.length), where


def both(loaded, ids, specs, tokens, **kwargs):
    return (compare(loaded, ids, specs, tokens, batched=True, **kwargs),
            compare(loaded, ids, specs, tokens, batched=False, **kwargs))


def small_budget_specs(budget: int, prompt: int) -> list[str]:
    """One SPEC per registered eviction method, squeezed to ``budget`` tokens so outputs part from full's."""
    return [budget_spec(name, budget, prompt) for name in EVICTIONS if name != "full"]


def test_batched_rows_equal_sequential_rows_for_every_eviction_method(tiny_model, story_ids):
    ids = story_ids[:60]
    specs = small_budget_specs(6, len(ids))
    batched, sequential = both(tiny_model, ids, specs, 10)
    assert_same_rows(batched, sequential)
    missing = [r for r in batched.results if r.error]
    assert all("install" in r.error for r in missing), [r.error for r in missing]  # only absent extras may fail
    assert len(batched.results) - len(missing) >= 2


def test_a_quantizer_and_a_composed_pair_equal_their_sequential_rows(tiny_model, story_ids):
    if "kivi" not in REGISTRY or "snapkv" not in REGISTRY:
        pytest.skip("kivi and snapkv are needed")
    ids = story_ids[:70]
    specs = ["kivi:bits=2,group=8,residual=8", "snapkv:budget=24,window=8+kivi:bits=2,group=8,residual=8",
             "streaming_llm:sinks=2,window=10,rerotate=0+kivi:bits=4,group=8,residual=4"]
    specs += [name for name, cls in REGISTRY.items() if cls.kind == "quantization" and name != "kivi"]
    batched, sequential = both(tiny_model, ids, specs, 12)
    assert_same_rows(batched, sequential)
    kivi = batched.by_method("kivi:group=8,residual=8")
    assert kivi.error is None and kivi.kv_breakdown.codes > 0, "the quantizer really quantized"


def test_teacher_forced_twins_give_the_sequential_agreement_kl_and_first_divergence(tiny_model, story_ids):
    ids = story_ids[:50]
    specs = small_budget_specs(5, len(ids))
    batched, sequential = both(tiny_model, ids, specs, 12)
    assert_same_rows(batched, sequential)
    full = batched.by_method("full")
    parted = [r for r in batched.results if r.error is None and r.token_ids != full.token_ids]
    assert parted, "budgets this small must make some method part from full (or the twins go untested)"
    assert any(r.first_divergence is not None and r.mean_kl > 0 for r in parted)


def test_seeded_sampling_gives_every_row_its_own_sampler(tiny_model, story_ids):
    ids = story_ids[:40]
    specs = ["window:window=8", "streaming_llm:sinks=2,window=6", "h2o:heavy=4,recent=4"]
    sampling = Sampling(temperature=1.0, top_k=20, seed=7)
    batched, sequential = both(tiny_model, ids, specs, 10, sampling=sampling)
    assert_same_rows(batched, sequential)


def test_rows_of_different_lengths_decode_together_in_one_forward_per_step(tiny_model, story_ids, monkeypatch):
    ids = story_ids[:64]
    specs = ["window:window=4", "window:window=40", "tova:budget=12", "h2o:heavy=10,recent=20", "random:budget=30"]
    forwards, lengths = [], []
    original_forward, original_update = batch.forward_rows, batch.BatchLayer.update

    def counting_forward(model, caches, *args):
        forwards.append(len(caches))
        return original_forward(model, caches, *args)

    def recording_update(self, *args, **kwargs):
        result = original_update(self, *args, **kwargs)
        lengths.append([part.keys.shape[2] for part in self.parts])
        return result

    monkeypatch.setattr(batch, "forward_rows", counting_forward)
    monkeypatch.setattr(batch.BatchLayer, "update", recording_update)
    batched = compare(tiny_model, ids, specs, 8, batched=True)
    monkeypatch.undo()
    sequential = compare(tiny_model, ids, specs, 8, batched=False)
    assert_same_rows(batched, sequential)
    assert len(forwards) == 7, "one forward per step after the first token, for every row at once"
    assert forwards[0] >= len(specs) + 1
    assert all(len(set(step)) >= 4 for step in lengths[:4]), "rows held caches of different lengths side by side"
    layers = len(lengths) // len(forwards)
    assert [len(step) for step in lengths] == [n for n in forwards for _ in range(layers)], "each row its own keys"


def test_attention_scoring_rows_get_their_own_probabilities_over_their_own_keys(tiny_model, story_ids, monkeypatch):
    seen = []
    original = H2O.select

    def spying(self, view):
        seen.append((view.attention.shape[-1], view.positions.shape[-1], view.attention.sum(-1)))
        return original(self, view)

    monkeypatch.setattr(H2O, "select", spying)
    compare(tiny_model, story_ids[:48], ["h2o:heavy=4,recent=4", "window:window=30"], 4, batched=True)
    assert seen
    for width, length, sums in seen:
        assert width == length, "a row attends over its own keys only"
        torch.testing.assert_close(sums, torch.ones_like(sums))


def test_a_failing_method_leaves_the_batch_and_the_others_finish(tiny_model, story_ids, monkeypatch):
    ids = story_ids[:48]
    specs = ["window:window=8", "h2o:heavy=4,recent=4", "tova:budget=10", "snapkv:budget=16,window=4"]
    sequential = compare(tiny_model, ids, specs, 8, batched=False)
    original_window, original_h2o = Window.select, H2O.select

    def window_breaks_at_step_3(self, view):
        if view.step == 3:
            raise RuntimeError("simulated kernel failure")
        return original_window(self, view)

    def h2o_breaks_at_step_5(self, view):  # inside the attention listener, not the cache update
        if view.step == 5:
            raise IndexError("simulated scoring failure")
        return original_h2o(self, view)

    monkeypatch.setattr(Window, "select", window_breaks_at_step_3)
    monkeypatch.setattr(H2O, "select", h2o_breaks_at_step_5)
    batched = compare(tiny_model, ids, specs, 8, batched=True)
    assert batched.by_method("window:window=8").error == "RuntimeError: simulated kernel failure"
    assert batched.by_method("h2o:heavy=4,recent=4").error == "IndexError: simulated scoring failure"
    for method in ("full", "tova:budget=10", "snapkv:budget=16,window=4"):
        ours, theirs = batched.by_method(method), sequential.by_method(method)
        assert ours.error is None and ours.token_ids == theirs.token_ids, method
        assert ours.kv_bytes_per_step == theirs.kv_bytes_per_step and ours.first_divergence == theirs.first_divergence


def test_a_method_that_cannot_fork_is_reported_and_the_batch_runs(tiny_model, story_ids):
    batched = compare(tiny_model, story_ids[:20], ["snapkv:budget=0.9", "window:window=8"], 4, batched=True)
    assert "not shorter than the prompt" in batched.by_method("snapkv:budget=0.9").error
    assert batched.by_method("window:window=8").error is None and len(batched.by_method("full").token_ids) == 4


def test_batched_comparison_on_the_real_model_equals_sequential(real_model, story_ids):
    ids = story_ids[:160]
    specs = ["streaming_llm:sinks=4,window=28", "snapkv:budget=32,window=8", "h2o:heavy=16,recent=16",
             "tova:budget=32"]
    if "kivi" in REGISTRY:
        specs += ["kivi:bits=2,group=16,residual=16", "snapkv:budget=32,window=8+kivi:bits=2,group=16,residual=16"]
    batched, sequential = both(real_model, ids, specs, 10)
    assert_same_rows(batched, sequential)
    assert not [r.error for r in batched.results if r.error]
    assert batched.by_method("full").text.strip()


def test_a_wave_prefills_the_blocks_its_prompts_share_once_and_each_prompt_equals_its_fresh_prefill(
        real_model, monkeypatch):
    """Task items share their chat preamble: a wave prefills it once and feeds each item only the rest, and on a CPU
    every item's logits and cache then equal its fresh prefill's bit for bit, so sharing changes no result."""
    items = stream_items(real_model.tokenizer, "multikey", 256, range(3), 0)
    forwards = []

    def checked(model, device, prompts, prefix, store=True):
        runs = prefill_together(model, device, prompts, prefix, store)
        forwards.append(([len(p) for p in prompts], [run.lookup.reused_tokens for run in runs]))
        if prefix is not None:
            for run, fresh in zip(runs, prefill_together(model, device, prompts, None), strict=True):
                assert torch.equal(run.last_logits, fresh.last_logits)
                for ours, theirs in zip(run.cache.layers, fresh.cache.layers, strict=True):
                    assert all(torch.equal(a, b) for a, b in zip(ours.storage.materialize(),
                                                                 theirs.storage.materialize(), strict=True))
        return runs

    monkeypatch.setattr(engine, "prefill_together", checked)
    decode_prompts(real_model, [item.ids for item in items], ["full"], 1, FREE)
    preamble = len(shared_prefixes([item.ids for item in items])[0])
    assert preamble >= 32 and forwards[0] == ([preamble], [0]), "the shared blocks first, in a forward of their own"
    assert {reused for _, runs in forwards[1:] for reused in runs} == {preamble}, "then every item after them"


def test_a_comparison_reports_its_prefill_before_any_model_work(tiny_model, story_ids):
    """The progress bar's first words name the prefill (seconds for a 2K prompt on a CPU), not a bare "waiting"."""
    reports = []
    compare(tiny_model, story_ids, ["window:window=8"], 3, progress=lambda f, m: reports.append((f, m)))
    assert reports[0] == (0.0, f"prefilling {len(story_ids):,} prompt tokens")
    assert reports[-1][0] == 1.0 and [f for f, _ in reports] == sorted(f for f, _ in reports)
