"""Gemma 3 270M, the second embedded model: MQA and 15 of 18 layers on a 512-token window, run exactly.

Few tests, each meaningful, on the session's one Gemma (``gemma_model``): a 2K-token prompt through
``python -m kvviz compare --model gemma3-270m`` against the model's own ``generate`` (32 greedy tokens, the model's
own cache's bytes, the per-layer-type formula), what its local layers hold, and the Needle page's default grid.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvviz.cli import main
from kvviz.lessons import ARCH_BUDGET, ARCH_EVICTION, held_bytes
from kvviz.methods import budget_spec
from kvviz.planning.memory import model_card
from kvviz.runs import NeedleRequest
from kvviz.studies.needle import build_needle_prompt

NEW_TOKENS = 32
PROMPT_TOKENS = 2048


@pytest.fixture(scope="module")
def two_k(gemma_model, tmp_path_factory):
    """A 2K-token pass-key prompt as text (what ``--prompt-file`` reads), its token ids (``<bos>`` first) and the
    model's own greedy continuation with the bytes its own cache holds after it."""
    prompt = build_needle_prompt(gemma_model.tokenizer, PROMPT_TOKENS, 0.5, chat=False)
    text = gemma_model.tokenizer.decode(prompt.ids, skip_special_tokens=True)
    assert gemma_model.tokenizer(text)["input_ids"] == prompt.ids
    model = gemma_model.model
    model.set_attn_implementation("sdpa")  # the model as transformers runs it, its own DynamicCache(config)
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt.ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("kvviz")
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    path = tmp_path_factory.mktemp("gemma") / "prompt.txt"
    path.write_text(text)
    return path, prompt, out.sequences[0, len(prompt.ids):].tolist(), held


def test_architectures_gemma3_full_on_2k_tokens_is_generate_token_for_token_and_byte_for_byte(
        gemma_model, two_k, monkeypatch, tmp_path):
    from kvviz import cli

    path, prompt, generated, own_cache_bytes = two_k
    assert prompt.ids[0] == gemma_model.tokenizer.bos_token_id and len(prompt.ids) > 2000
    monkeypatch.setattr(cli.options, "load", lambda args: gemma_model)  # the session's Gemma, loaded once
    out = tmp_path / "compare.json"
    assert main(["compare", "--model", "gemma3-270m", "--prompt-file", str(path), "--method", "full", "--method",
                 ARCH_EVICTION, "--max-new-tokens", str(NEW_TOKENS), "--json", str(out), "--quiet"]) == 0
    full, evicted = json.loads(out.read_text())["results"]
    assert len(generated) == NEW_TOKENS and full["token_ids"] == generated
    card = model_card(gemma_model)
    tokens = len(prompt.ids) + NEW_TOKENS - 1  # the last token is never fed
    assert full["kv_bytes"] == full["kv_bytes_full"] == own_cache_bytes == card.stored_kv_bytes(tokens)
    assert card.stored_kv_bytes(tokens) == 2 * 256 * 4 * (3 * tokens + 15 * 511)  # per layer type, float32
    # the eviction runs on the 3 global layers only: 256 tokens there, the local layers' 511 untouched
    assert evicted["kv_bytes"] == held_bytes(card, tokens, ARCH_BUDGET) == 2 * 256 * 4 * (3 * 256 + 15 * 511)
    kinds = full["ledger"]["layer_types"]
    assert kinds.count("local 512") == 15 and [i for i, k in enumerate(kinds) if k == "global"] == [5, 11, 17]
    kept = full["ledger"]["kept_per_layer"]
    assert all(kept[i] == [511 if kind != "global" else tokens] for i, kind in enumerate(kinds))


def test_architectures_gemma3_needle_default_grid_runs_full_streaming_llm_and_snapkv(gemma_model):
    """The Needle page's defaults (two lengths, three depths, chat off on a base model) on Gemma: every cell of every
    method runs within its length, and full keeps every key and finds some."""
    specs = ("full", budget_spec("streaming_llm", 64), budget_spec("snapkv", 64))  # the page's own defaults
    request = NeedleRequest(specs, (128, 256), (0.1, 0.5, 0.9), 1, "query_aware", False, 12)
    report = gemma_model.engine.submit(request.job(gemma_model), "test").result(600)
    assert sorted((c.method, c.length, c.depth) for c in report.cells) == sorted(
        (s, n, d) for s in specs for n in (128, 256) for d in (0.1, 0.5, 0.9))
    assert all(c.prompt_tokens <= c.length for c in report.cells)
    full = [c for c in report.cells if c.method == "full"]
    assert all(c.survived for c in full)  # the prompts fit in the window: nothing left even a local layer
    assert sum(c.found for c in full) >= 2  # the base model reads its haystacks (3 of 6 measured 2026-12-06)
