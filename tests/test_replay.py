"""The replay engine: `full` reproduces model.generate, positions are explicit, bytes match the formula."""

import pytest
import torch

from kvviz.comparison.session import PromptError, PromptSession, compare, encode_prompt
from kvviz.planning.memory import model_card


def _generate(loaded, ids, n):
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_full_matches_generate_on_tiny_model(tiny_model, story_ids):
    session = PromptSession(tiny_model, story_ids[:50])
    result, _ = session.run("full", max_new_tokens=20)
    assert result.token_ids == _generate(tiny_model, story_ids[:50], 20)


def test_full_matches_generate_on_real_model(real_model):
    ids = encode_prompt(real_model.tokenizer, "List three uses of a paperclip.", chat=True)
    comparison = compare(real_model, ids, ["full"], max_new_tokens=32)
    result = comparison.results[0]
    assert result.token_ids == _generate(real_model, ids, 32)
    assert result.agreement_with_full == 1.0 and result.first_divergence is None


def test_measured_bytes_equal_the_formula_for_full(real_model, story_ids):
    session = PromptSession(real_model, story_ids)
    result, _ = session.run("full", max_new_tokens=5)
    card = model_card(real_model)
    held_tokens = len(story_ids) + len(result.token_ids) - 1
    assert result.kv_bytes == card.kv_bytes(held_tokens) == result.kv_bytes_full
    assert len(result.kv_bytes_per_layer) == 30
    assert result.kv_bytes_per_step[0] == card.kv_bytes(len(story_ids))
    assert all(b - a == card.kv_bytes_per_token for a, b in zip(result.kv_bytes_per_step,
                                                                  result.kv_bytes_per_step[1:], strict=False))


def test_new_tokens_get_their_absolute_positions(tiny_model, story_ids):
    session = PromptSession(tiny_model, story_ids[:30])
    cache = session.fork(session_stack("full"))
    prefill = session.prefill()
    from kvviz.runtime.replay import decode

    decode(tiny_model.model, cache, prefill.last_logits, 4, "cpu", set())
    assert cache.kept_positions(0)[0].tolist() == list(range(33))


def session_stack(spec):
    from kvviz.methods import parse_spec

    return parse_spec(spec)


def test_seeded_sampling_is_reproducible(tiny_model, story_ids):
    from kvviz.runtime.replay import Sampling

    session = PromptSession(tiny_model, story_ids[:20])
    first, _ = session.run("full", 12, Sampling(temperature=1.0, seed=7))
    second, _ = session.run("full", 12, Sampling(temperature=1.0, seed=7))
    other, _ = session.run("full", 12, Sampling(temperature=1.0, seed=8))
    assert first.token_ids == second.token_ids != other.token_ids


def test_bad_prompts_are_refused_clearly(tiny_model):
    with pytest.raises(PromptError, match="empty"):
        encode_prompt(tiny_model.tokenizer, "   ")
    with pytest.raises(PromptError, match="context"):
        PromptSession(tiny_model, [5] * 4096)
