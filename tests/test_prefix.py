"""The prefix cache (kvviz.runtime.prefix): chained block hashes, LRU under a byte budget; and prefilling through it
(kvviz.runtime.prefill), which equals a fresh prefill."""

from __future__ import annotations

import threading

import torch

from kvviz.cache.capture import CaptureConfig
from kvviz.comparison.session import PromptSession, compare
from kvviz.runtime.prefill import prefill_together, prefill_with_prefix, reusable_tokens
from kvviz.runtime.prefix import PrefixCache, block_hashes, shared_prefixes


def test_same_tokens_give_same_hashes_and_only_whole_blocks():
    ids = list(range(100))
    assert block_hashes(ids, 16) == block_hashes(list(ids), 16)
    assert len(block_hashes(ids, 16)) == 6  # 96 tokens in whole blocks, the last 4 left out
    assert block_hashes(ids[:40], 16) == block_hashes(ids, 16)[:2]


def test_shared_prefixes_are_the_longest_whole_blocks_two_prompts_begin_with():
    preamble, document = list(range(1000, 1040)), list(range(2000, 2100))
    prompts = [preamble + document + [1], [7] * 50, preamble + [3] * 30, [9] * 40 + [1], preamble + document + [2],
               preamble[:20], [9] * 40 + [2]]
    # the preamble's 32 whole tokens that the third prompt shares are the start of the 128 the first and fifth share
    assert shared_prefixes(prompts, 16) == [(preamble + document)[:128], [9] * 32]
    assert shared_prefixes([preamble + [1], preamble[:10]], 16) == [], "no whole block in common"
    assert shared_prefixes([preamble, preamble], 16) == [preamble[:32]], "one prefix once, however many share it"
    assert shared_prefixes([preamble], 16) == []


def test_one_token_change_invalidates_its_block_and_every_later_one():
    ids = list(range(200))
    changed = list(ids)
    changed[37] = 999  # inside block 2
    before, after = block_hashes(ids, 16), block_hashes(changed, 16)
    assert before[:2] == after[:2]
    assert all(a != b for a, b in zip(before[2:], after[2:], strict=True))


def test_salt_separates_namespaces():
    ids = list(range(64))
    assert not set(block_hashes(ids, 16, salt="alice")) & set(block_hashes(ids, 16, salt="bob"))
    cache = PrefixCache(block_tokens=4)
    cache.store(ids[:8], _dense_cache(8), salt="alice")
    assert cache.lookup(ids[:9], salt="alice").reused_tokens == 8
    assert cache.lookup(ids[:9], salt="bob").reused_tokens == 0


def _dense_cache(tokens: int, layers: int = 2, heads: int = 2, dim: int = 4):
    """A dense KVCache holding ``tokens`` random entries per layer (what a prefill leaves)."""
    from kvviz.cache.kvcache import KVCache

    cache = KVCache(layers)
    for layer in cache.layers:
        keys, values = torch.randn(1, heads, tokens, dim), torch.randn(1, heads, tokens, dim)
        layer.lazy_initialization(keys, values)
        layer.storage.append(keys, values)
    return cache


def test_lru_evicts_least_recently_used_chain_tail_first_under_byte_budget():
    block_bytes = 2 * 2 * 2 * 4 * 4 * 4  # keys+values x layers x heads x tokens x dim x float32
    cache = PrefixCache(block_tokens=4, budget_bytes=5 * block_bytes)
    first, second = list(range(12)), list(range(100, 112))
    cache.store(first, _dense_cache(12))
    cache.store(second, _dense_cache(12))
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 5
    assert cache.stats.evicted_blocks == 1
    # the oldest chain lost its tail, not its head: it still serves its first two blocks
    assert cache.lookup(first + [7]).reused_tokens == 8
    assert cache.lookup(second + [7]).reused_tokens == 12
    cache.lookup(first + [7])  # touch the first chain again: the second is now the older one
    cache.store(list(range(200, 208)), _dense_cache(8))
    assert cache.nbytes <= cache.budget_bytes
    assert cache.lookup(first + [7]).reused_tokens == 8
    assert cache.lookup(second + [7]).reused_tokens == 4


def test_lookup_leaves_the_last_token_to_feed_and_marks_partial_blocks():
    cache = PrefixCache(block_tokens=4)
    ids = list(range(10))
    cache.store(ids[:8], _dense_cache(8))
    lookup = cache.lookup(ids[:8])  # the whole prompt is cached, but its last token must be fed
    assert lookup.reused_tokens == 4
    assert [b.status for b in lookup.blocks] == ["hit", "recomputed"]
    assert [b.status for b in cache.lookup(ids).blocks] == ["hit", "hit", "partial"]


def test_reusable_tokens_follow_what_the_capture_reads():
    assert reusable_tokens(None, 100) == 99
    assert reusable_tokens(CaptureConfig(windows=(32,), all_queries=False), 100) == 68
    assert reusable_tokens(CaptureConfig(), 100) == 0  # sink mass and received attention over every query
    assert reusable_tokens(CaptureConfig(windows=(8,), all_queries=False, layer_inputs=True), 100) == 0


def test_reused_prefill_equals_fresh_prefill(tiny_model, story_ids):
    cache = PrefixCache(block_tokens=16)
    preamble = story_ids[:100]
    prefill_with_prefix(tiny_model.model, "cpu", preamble + story_ids[150:160], cache)
    prompt = preamble + story_ids[200:230]
    reused = prefill_with_prefix(tiny_model.model, "cpu", prompt, cache)
    fresh = prefill_with_prefix(tiny_model.model, "cpu", prompt, None)
    assert reused.lookup.reused_tokens == 96
    assert torch.allclose(reused.last_logits, fresh.last_logits, atol=1e-4)
    for a, b in zip(reused.cache.layers, fresh.cache.layers, strict=True):
        assert torch.allclose(a.storage.materialize()[0], b.storage.materialize()[0], atol=1e-5)
        assert torch.equal(a.positions, b.positions)


def test_prompts_prefilled_together_equal_each_prefilled_alone(tiny_model, story_ids):
    cache = PrefixCache(block_tokens=16)
    prefill_with_prefix(tiny_model.model, "cpu", story_ids[:40], cache)  # the third prompt reuses its first two blocks
    prompts = [story_ids[:23], story_ids[50:90], story_ids[:37], story_ids[100:101]]
    together = prefill_together(tiny_model.model, "cpu", prompts, cache)
    assert [run.lookup.reused_tokens for run in together] == [16, 0, 32, 0]
    for prompt, run in zip(prompts, together, strict=True):
        alone = prefill_with_prefix(tiny_model.model, "cpu", prompt, cache, store=False)
        assert torch.allclose(run.last_logits, alone.last_logits, atol=1e-5)
        assert run.cache.prompt_length == len(prompt)
        for ours, theirs in zip(run.cache.layers, alone.cache.layers, strict=True):
            assert len(ours.storage) == len(prompt), "padding is never stored"
            for a, b in zip(ours.storage.materialize(), theirs.storage.materialize(), strict=True):
                assert torch.allclose(a, b, atol=1e-5)
            assert torch.equal(ours.positions, theirs.positions) and torch.equal(ours.rotary, theirs.rotary)
    assert prefix_lookup_reuses(cache, story_ids[50:90]) == 32, "each prompt stores its own new blocks"


def prefix_lookup_reuses(cache: PrefixCache, prompt: list[int]) -> int:
    return cache.lookup(prompt).reused_tokens


def test_snapkv_served_from_a_partial_prefill_keeps_the_same_tokens(tiny_model, story_ids):
    spec = "snapkv:budget=48,window=8,kernel=3"
    preamble = story_ids[:96]
    prompt = preamble + story_ids[120:140]
    PromptSession(tiny_model, preamble + story_ids[160:170], reuse_prefix=True).prefill()  # fills the model's cache
    session = PromptSession(tiny_model, prompt, reuse_prefix=True)
    from kvviz.methods import parse_spec

    reused = session.fork(parse_spec(spec))
    assert session.prefill(session._capture).reused_tokens == 96
    fresh = PromptSession(tiny_model, prompt).fork(parse_spec(spec))
    for layer in range(2):
        assert torch.equal(reused.kept_positions(layer), fresh.kept_positions(layer))


def test_compare_reuses_the_prefix_and_gives_the_same_tokens(tiny_model, story_ids):
    preamble = story_ids[:64]
    compare(tiny_model, preamble + story_ids[100:110], ["full"], max_new_tokens=4)
    reused = compare(tiny_model, preamble + story_ids[120:130], ["full", "window:window=16"], max_new_tokens=6)
    fresh = compare(tiny_model, preamble + story_ids[120:130], ["full", "window:window=16"], max_new_tokens=6,
                    reuse_prefix=False)
    assert [r.token_ids for r in reused.results] == [r.token_ids for r in fresh.results]


def test_model_prefix_cache_is_shared_and_safe_across_threads(tiny_model, story_ids):
    prefix = tiny_model.prefix_cache
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        prompt = story_ids[:48] + story_ids[60 + offset:70 + offset]
        try:
            prefill_with_prefix(tiny_model.model, "cpu", prompt, prefix)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert prefix.nbytes == sum(block.nbytes for block in prefix._blocks.values())
    reusing = PromptSession(tiny_model, story_ids[:48] + [7], reuse_prefix=True)
    assert reusing.prefill().reused_tokens == 48, "every run on the model reads the blocks the others stored"


def test_capture_over_every_query_prefills_the_whole_prompt(tiny_model, story_ids):
    ids = story_ids[:64]
    PromptSession(tiny_model, ids + [5], reuse_prefix=True).prefill()
    prefill = PromptSession(tiny_model, ids + [6], reuse_prefix=True).prefill(CaptureConfig())
    assert prefill.reused_tokens == 0
    assert prefill.stats.sink_mass[0].shape[-1] == 65  # every query's sink mass, which reused blocks cannot give
    assert PromptSession(tiny_model, ids + [7], reuse_prefix=True).prefill().reused_tokens == 64
