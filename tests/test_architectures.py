"""Every common hub architecture runs ``full`` exactly as the model runs itself, or is refused by name.

Each type is a tiny random-weight model built from its own transformers config (no download), with SmolLM2's
tokenizer and a prompt three times longer than the sliding window. Against the model's own ``generate`` (eager
attention, transformers' own cache): the greedy tokens are equal through ``python -m kvviz compare --model DIR``
and through the engine's batched compare; every step's log-probabilities are within 1e-4 (float32); the bytes
equal what the model's own cache holds after generating, and the per-layer-type formula at every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvviz.cache.layer_types import REFUSALS, LayerTypes, refusal_for
from kvviz.cli import main
from kvviz.comparison.session import PromptSession, compare
from kvviz.methods import parse_spec
from kvviz.planning.memory import model_card
from kvviz.runtime.models import ModelError, prepare_default_model, ready

WINDOW = 24
NEW_TOKENS = 16
PROMPT = ("The lighthouse keeper of Saint Brennan's Rock kept a logbook for forty years. Every evening he wrote the "
          "wind, the swell, the ships that passed, and one sentence about the birds. ") * 2
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, eos_token_id=2, pad_token_id=2, bos_token_id=1,
             tie_word_embeddings=True, initializer_range=0.2)  # weights wide enough that attention is not uniform
# model type -> what its tiny config sets beyond SHAPE (each one's own feature switched on)
EXACT = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),  # q/k/v bias, 2 local layers
    "qwen3": {},  # q/k norm
    "mistral": dict(sliding_window=WINDOW),  # every layer local
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16),  # alternating local/global, soft-capped logits
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),  # two rope bases
    "phi3": dict(sliding_window=WINDOW),  # fused qkv, every layer local
    "olmo2": {},  # q/k norm over the whole projection
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1),  # MLA: keys of 24 channels, values of 16
}
# model type -> (its config's fields, the feature its refusal names); one example of every refusal kvviz makes
REFUSED = {
    "llama4_text": ({}, "chunked local attention"),
    "qwen3_next": ({}, "linear or recurrent layers"),
    "gpt_oss": ({}, "learned attention sinks"),
    "gemma3n_text": ({}, "KV shared across layers"),
    "gemma3_text": ({"use_bidirectional_attention": True}, "bidirectional attention"),
    "bloom": ({}, "attention outside transformers' AttentionInterface"),
}


@dataclass
class Reference:
    """What the model's own ``generate`` gives: greedy tokens, each step's log-probabilities, its cache's bytes."""

    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab]
    cache_bytes: int


def tiny_model(model_type: str, vocab_size: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(SHAPE | {"vocab_size": vocab_size} | EXACT[model_type]))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 2
    return model


def generated(model: torch.nn.Module, prompt_ids: list[int]) -> Reference:
    """Greedy ``generate`` with the model's reference (eager) attention and transformers' own cache."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    return Reference(tokens, logprobs, held)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_default_model())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 3 * WINDOW
    return ids


@pytest.mark.parametrize("model_type", sorted(EXACT))
def test_architectures_full_runs_exactly_as_the_model_runs_itself(model_type, tokenizer, prompt_ids, tmp_path):
    model = tiny_model(model_type, len(tokenizer))
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    reference = generated(model, prompt_ids)
    (tmp_path / "prompt.txt").write_text(PROMPT)
    out = tmp_path / "compare.json"

    assert main(["compare", "--model", str(folder), "--device", "cpu", "--prompt-file", str(tmp_path / "prompt.txt"),
                 "--method", "full", "--max-new-tokens", str(NEW_TOKENS), "--json", str(out), "--quiet"]) == 0
    cli = json.loads(out.read_text())["results"][0]
    assert cli["token_ids"] == reference.tokens
    assert cli["kv_bytes"] == cli["kv_bytes_full"] == reference.cache_bytes

    loaded = ready(model_type, model, tokenizer, "cpu", torch.float32)
    card = model_card(loaded)
    batched = compare(loaded, prompt_ids, ["full"], NEW_TOKENS).results[0]
    assert batched.token_ids == reference.tokens
    assert batched.kv_bytes_per_step == [card.stored_kv_bytes(len(prompt_ids) + step)
                                         for step in range(len(reference.tokens))]
    _, trace = PromptSession(loaded, prompt_ids).run("full", NEW_TOKENS, keep_logprobs=True)
    assert (torch.stack(trace.step_logprobs) - reference.logprobs).abs().max() < 1e-4


def test_architectures_local_layers_hold_their_window_as_the_model_s_own_cache_does():
    from transformers import AutoConfig

    gemma = LayerTypes.from_config(AutoConfig.for_model("gemma3_text", **(SHAPE | EXACT["gemma3_text"])))
    assert gemma.windows == (WINDOW, WINDOW, WINDOW, None)
    assert [gemma.held(0, n) for n in (10, WINDOW - 1, WINDOW, 100)] == [10, WINDOW - 1, WINDOW - 1, WINDOW - 1]
    assert gemma.held(3, 100) == 100
    assert gemma.listing() == "local (window 24): 0-2; global: 3" and gemma.summary() == (
        "3 local (window 24) + 1 global of 4 layers")
    qwen = LayerTypes.from_config(AutoConfig.for_model("qwen2", **(SHAPE | EXACT["qwen2"])))
    assert qwen.windows == (None, None, WINDOW, WINDOW)  # the first max_window_layers attend globally
    assert not LayerTypes.from_config(AutoConfig.for_model("qwen2")).has_local  # its window is off by default
    assert LayerTypes.from_config(AutoConfig.for_model("mistral", sliding_window=WINDOW)).local_layers == 32


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_architectures_kvviz_cannot_run_exactly_are_refused_by_name_before_any_work(model_type, tmp_path, capsys):
    from transformers import AutoConfig

    fields, feature = REFUSED[model_type]
    config = AutoConfig.for_model(model_type, **fields)
    assert feature in refusal_for(config)
    config.save_pretrained(tmp_path)  # a config and no weights: the refusal comes before anything loads
    (tmp_path / "prompt.txt").write_text(PROMPT)
    assert main(["compare", "--model", str(tmp_path), "--prompt-file", str(tmp_path / "prompt.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and feature in err and model_type in err


def test_architectures_pinned_list_names_every_refusal_and_the_docs_print_it():
    assert {feature for _, feature in REFUSED.values()} == {refusal.feature for refusal in REFUSALS}
    assert not set(EXACT) & {t for t, (fields, _) in REFUSED.items() if not fields}
    docs = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    for refusal in REFUSALS:
        assert f"| {refusal.feature} |" in docs and ", ".join(refusal.examples) in docs
    assert ", ".join(sorted(EXACT)) in docs


def test_architectures_a_model_built_in_memory_is_refused_too():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma3_text", **(SHAPE | {"vocab_size": 64, "use_bidirectional_attention": True}))
    with pytest.raises(ModelError, match="bidirectional attention"):
        ready("bidirectional", AutoModelForCausalLM.from_config(config), None, "cpu", torch.float32)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2"])
def test_architectures_chunked_and_streamed_perplexity_keep_local_windows_exactly(model_type, tokenizer, prompt_ids,
                                                                                   monkeypatch):
    """Several tokens per forward into a cache whose local layers hold only their windows (the full cache's chunks),
    and one token per forward through a forked cache (a method streamed), both equal the model's own forward."""
    from kvviz.studies import perplexity

    model = tiny_model(model_type, len(tokenizer))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    own = torch.nn.functional.cross_entropy(logits, torch.tensor(prompt_ids[1:]), reduction="none")
    loaded = ready(model_type, model, tokenizer, "cpu", torch.float32)
    monkeypatch.setattr(perplexity, "CHUNK", 16)  # chunks shorter than the prompt, each past the window's start
    full = perplexity.streaming_perplexity(loaded, prompt_ids, "full")
    streamed = perplexity.streaming_perplexity(loaded, prompt_ids, "window:window=1000")  # evicts nothing
    assert (torch.tensor(full.per_token_nll) - own).abs().max() < 1e-4
    assert (torch.tensor(streamed.per_token_nll) - own).abs().max() < 1e-4
    assert full.kv_bytes == streamed.kv_bytes == model_card(loaded).stored_kv_bytes(len(prompt_ids) - 1)


def test_architectures_rerotation_moves_each_layer_s_keys_with_its_own_rope_or_is_refused(tokenizer, prompt_ids):
    """Gemma 3 rotates local layers with base 10K and global ones with 1M: moving a key by d positions must equal the
    model's own rotary embedding at p + d, per layer type. MLA's partial, interleaved RoPE cannot be moved: refused."""
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    from kvviz.cache.rotation import rope_rotator
    from kvviz.methods import SpecError

    model = tiny_model("gemma3_text", len(tokenizer))
    rotator = rope_rotator(model)
    key = torch.randn(1, 1, 1, SHAPE["head_dim"])
    for layer, kind in enumerate(model.config.layer_types):
        cos, sin = model.model.rotary_emb(key, torch.tensor([[3, 10]]), kind)
        at_3, _ = apply_rotary_pos_emb(key, key, cos[:, :1], sin[:, :1])
        at_10, _ = apply_rotary_pos_emb(key, key, cos[:, 1:], sin[:, 1:])
        moved = rotator.for_layer(layer).apply(at_3, *rotator.for_layer(layer).angles(torch.tensor([7]), key.dtype))
        assert torch.allclose(moved, at_10, atol=1e-5), kind
    assert not torch.equal(rotator.for_layer(0).inv_freq, rotator.for_layer(3).inv_freq)
    loaded = ready("deepseek_v3", tiny_model("deepseek_v3", len(tokenizer)), tokenizer, "cpu", torch.float32)
    with pytest.raises(SpecError, match="RoPE covers only part of each key"):
        PromptSession(loaded, prompt_ids).fork(parse_spec("streaming_llm:sinks=4,window=8"))


def test_architectures_a_storage_that_cannot_drop_tokens_says_so_on_a_local_layer(tokenizer, prompt_ids):
    loaded = ready("gemma3_text", tiny_model("gemma3_text", len(tokenizer)), tokenizer, "cpu", torch.float32)
    results = compare(loaded, prompt_ids, ["full", "hf_quantized:backend=quanto,nbits=4,group=16"], 2).results
    assert results[0].error is None and "is local (window 24) and drops what leaves its window" in results[1].error


def test_architectures_prompts_prefilled_together_keep_each_local_window(tokenizer, prompt_ids):
    """Prompts of different lengths in one forward (right-padded, each row over its own keys, the window in the
    mask kvviz builds) and their rows decoded together give each prompt the model's own greedy tokens."""
    from kvviz.comparison.batched import decode_prompts
    from kvviz.comparison.session import FREE

    model = tiny_model("gemma3_text", len(tokenizer))
    prompts = [prompt_ids, prompt_ids[5:60]]
    references = [generated(model, ids).tokens for ids in prompts]
    loaded = ready("gemma3_text", model, tokenizer, "cpu", torch.float32)
    results = decode_prompts(loaded, prompts, ["full", "window:window=8"], NEW_TOKENS, FREE)
    assert [rows[0].token_ids for rows in results] == references
    assert [rows[1].kv_bytes for rows in results] == [2 * 2 * 16 * 4 * 8 * 4] * 2  # 8 tokens in every layer
