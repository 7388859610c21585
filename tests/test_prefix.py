"""Prefix reuse: chained block hashes, LRU under a byte budget, and reuse that equals a fresh prefill."""

from __future__ import annotations

import threading

import torch

from kvviz.cache.capture import CaptureConfig
from kvviz.engine.session import PromptSession, compare
from kvviz.runtime.prefix import (
    PrefixCache,
    block_hashes,
    prefill_together,
    prefill_with_prefix,
    prefix_cache_for,
    reusable_tokens,
    run_turns,
)


def test_same_tokens_give_same_hashes_and_only_whole_blocks():
    ids = list(range(100))
    assert block_hashes(ids, 16) == block_hashes(list(ids), 16)
    assert len(block_hashes(ids, 16)) == 6  # 96 tokens in whole blocks, the last 4 left out
    assert block_hashes(ids[:40], 16) == block_hashes(ids, 16)[:2]


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
    prefill_with_prefix(tiny_model, preamble + story_ids[150:160], cache)
    prompt = preamble + story_ids[200:230]
    reused = prefill_with_prefix(tiny_model, prompt, cache)
    fresh = prefill_with_prefix(tiny_model, prompt, None)
    assert reused.lookup.reused_tokens == 96
    assert torch.allclose(reused.last_logits, fresh.last_logits, atol=1e-4)
    for a, b in zip(reused.cache.layers, fresh.cache.layers, strict=True):
        assert torch.allclose(a.storage.materialize()[0], b.storage.materialize()[0], atol=1e-5)
        assert torch.equal(a.positions, b.positions)


def test_prompts_prefilled_together_equal_each_prefilled_alone(tiny_model, story_ids):
    cache = PrefixCache(block_tokens=16)
    prefill_with_prefix(tiny_model, story_ids[:40], cache)  # the third prompt reuses its first two blocks
    prompts = [story_ids[:23], story_ids[50:90], story_ids[:37], story_ids[100:101]]
    together = prefill_together(tiny_model, prompts, cache)
    assert [run.lookup.reused_tokens for run in together] == [16, 0, 32, 0]
    for prompt, run in zip(prompts, together, strict=True):
        alone = prefill_with_prefix(tiny_model, prompt, cache, store=False)
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
    prefix = prefix_cache_for(tiny_model)
    assert prefix_cache_for(tiny_model) is prefix
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            with tiny_model.lock:
                prefill_with_prefix(tiny_model, story_ids[:48] + story_ids[60 + offset:70 + offset], prefix)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert prefix.nbytes == sum(block.nbytes for block in prefix._blocks.values())


def test_turns_sharing_a_preamble_hit_every_preamble_block(tiny_model, story_ids):
    preamble = story_ids[:80]
    report = run_turns(tiny_model, [preamble + story_ids[90:100], preamble + story_ids[100:112]])
    first, second = report.turns
    assert first.lookup.hits == 0 and second.lookup.hits == 5
    assert second.max_logit_diff < 1e-4 and second.same_next_token


def test_real_model_reuse_is_exact(real_model, story_ids):
    preamble = story_ids[:160]
    report = run_turns(real_model, [preamble + story_ids[170:190], preamble + story_ids[190:215]])
    assert report.turns[1].lookup.reused_tokens == 160
    assert report.turns[1].max_logit_diff < 1e-3


SHORT_PREAMBLE = (
    "<|im_start|>system\nYou are Harbourmaster, the ferry help desk. Answer in one short sentence.\n"
    "Ferries leave Port Ellen for the Rock at 07:15, 10:30, 14:00 and 18:45 in summer.\n"
    "A bicycle costs 3 pounds, a kayak 8 pounds, an adult single 14 pounds.\n"
    "Every vessel has a lift and two accessible toilets; wheelchair users board first.<|im_end|>\n"
)


def test_prefix_page_figures_equal_the_engines(monkeypatch, tmp_path, real_model):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from kvviz.runtime.prefix import DEFAULT_QUESTIONS, edit_preamble, turn_ids
    from kvviz.studies.prefix_sharing import compare_sharing

    preamble_file = tmp_path / "preamble.txt"
    preamble_file.write_text(SHORT_PREAMBLE, encoding="utf-8")
    monkeypatch.setattr("kvviz.runtime.prefix.PREAMBLE_FILE", preamble_file)
    spec = "streaming_llm:sinks=4,window=24,rerotate=0"
    app = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "views" / "7_Prefix_reuse.py"),
                            default_timeout=900)
    app.query_params["len"] = ["128"]
    app.query_params["m"] = [spec]
    app.query_params["n"] = "3"
    app.run()
    assert not app.exception and not app.get("plotly_chart"), "nothing runs before the button is pressed"
    next(b for b in app.button if b.label == "Run prefix reuse").click().run()
    assert len(app.get("plotly_chart")) == 3, "the turns and byte stability; the later sections wait for their buttons"
    for label in ("Compress the preamble for A and B (2 runs)", "Prefill 1 length"):
        next(b for b in app.button if b.label == label).click().run()
    assert not app.exception and not app.error, [e.value for e in app.error]
    assert len(app.get("plotly_chart")) == 5  # block table, TTFT, stability table, Jaccard, context cost

    tokenizer = real_model.tokenizer
    pieces = [turn_ids(tokenizer, SHORT_PREAMBLE, q) for q in DEFAULT_QUESTIONS]
    edited = turn_ids(tokenizer, edit_preamble(SHORT_PREAMBLE, "timestamp", 1), DEFAULT_QUESTIONS[-1])
    prompts = [p + q for p, q in pieces] + [edited[0] + edited[1]]
    engine = run_turns(real_model, prompts, block_tokens=16)
    shown = app.dataframe[0].value
    assert list(shown["hit_blocks"]) == [t.lookup.hits for t in engine.turns[:-1]]
    assert list(shown["reused_tokens"]) == [t.lookup.reused_tokens for t in engine.turns[:-1]]
    assert engine.turns[1].lookup.hits == len(pieces[0][0]) // 16
    metrics = {m.label: m.value for m in app.metric}
    edited_turn = engine.turns[-1]
    assert metrics["Blocks reused after the edit"] == f"{edited_turn.lookup.hits} / {len(edited_turn.lookup.blocks)}"
    assert edited_turn.lookup.hits < engine.turns[1].lookup.hits

    sharing = compare_sharing(real_model, pieces[0][0], pieces[0][1], pieces[1][1], [spec], 3)
    table = app.dataframe[1].value
    assert list(table["Jaccard (mean)"]) == [r.jaccard for r in sharing.rows]
    assert list(table["shareable"]) == [r.shareable for r in sharing.rows]


def test_cli_prefix_refuses_a_method_that_does_not_evict(capsys):
    from kvviz.cli import main

    assert main(["prefix", "--method", "kivi:bits=2", "--quiet"]) == 2
    assert "prefix sharing compares eviction methods" in capsys.readouterr().err


def test_cli_prefix_json_to_stdout_is_the_json_alone(tiny_model, monkeypatch, capsys, tmp_path):
    import json

    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    preamble = tmp_path / "preamble.txt"
    preamble.write_text(SHORT_PREAMBLE, encoding="utf-8")
    assert cli.main(["prefix", "--preamble-file", str(preamble), "--method", "streaming_llm:sinks=4,window=24",
                     "--max-new-tokens", "2", "--quiet", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_tokens"] == 16 and len(data["turns"]) == len(data["block_tables"]) == 2
    assert len(data["sharing"]) == 2 and all(row["method"].startswith("streaming_llm") for row in data["sharing"])
    assert data["turns"][1]["hit_blocks"] == data["preamble_tokens"] // 16


def test_edits_change_every_block_from_the_edit_on(real_model):
    from kvviz.runtime.prefix import default_preamble, edit_preamble

    tokenizer = real_model.tokenizer
    original = default_preamble()
    late = len(original.split("\n")) - 3
    for edit, line, changed_early in (("timestamp", 1, True), ("reorder", late, False)):
        before = block_hashes(tokenizer(original)["input_ids"])
        after = block_hashes(tokenizer(edit_preamble(original, edit, line))["input_ids"])
        first = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        assert (first < 3) == changed_early
        assert all(a != b for a, b in zip(before[first:], after[first:], strict=False))


def test_capture_over_every_query_prefills_the_whole_prompt(tiny_model, story_ids):
    ids = story_ids[:64]
    PromptSession(tiny_model, ids + [5], reuse_prefix=True).prefill()
    prefill = PromptSession(tiny_model, ids + [6], reuse_prefix=True).prefill(CaptureConfig())
    assert prefill.reused_tokens == 0
    assert prefill.stats.sink_mass[0].shape[-1] == 65  # every query's sink mass, which reused blocks cannot give
    assert PromptSession(tiny_model, ids + [7], reuse_prefix=True).prefill().reused_tokens == 64
