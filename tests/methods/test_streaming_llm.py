"""streaming_llm: sinks plus window at every step; absolute or re-rotated positions; the Hamlet finding."""

from __future__ import annotations

import pytest
import torch

from kvviz.methods import SpecError, parse_spec
from kvviz.studies.perplexity import play_text, streaming_perplexity
from tests.methods.test_window import prompt, step_through


def test_keeps_sinks_and_last_window_at_every_step(tiny_model):
    ids = prompt(tiny_model, 30)

    def check(cache, step):
        seen = len(ids) + step
        expected = [0, 1, 2, *range(seen - 8, seen)]
        kept = cache.ledger.kept_mask(step, seen)
        for layer in range(2):
            assert cache.kept_positions(layer).tolist() == [expected, expected]
            assert torch.nonzero(kept[layer, 1]).flatten().tolist() == expected

    step_through(tiny_model, ids, "streaming_llm:sinks=3,window=8", 12, check)


def test_rerotate_0_keeps_absolute_positions(tiny_model):
    ids = prompt(tiny_model, 30)

    def check(cache, step):
        if step:
            assert cache.step_rotary.tolist() == [len(ids) + step - 1]  # the new token's RoPE position
        for layer in cache.layers:
            assert torch.equal(layer.rotary, layer.positions)

    step_through(tiny_model, ids, "streaming_llm:sinks=4,window=8,rerotate=0", 10, check)


def test_rerotate_1_gives_consecutive_in_cache_positions(tiny_model):
    ids = prompt(tiny_model, 30)

    def check(cache, step):
        for layer in cache.layers:
            rotary = layer.rotary[0, 0]
            assert torch.equal(rotary - rotary[0], torch.arange(rotary.numel()))
        if step:
            assert cache.step_rotary.tolist() == [int(cache.layers[0].rotary.max())]  # newest key = its query

    step_through(tiny_model, ids, "streaming_llm:sinks=4,window=8,rerotate=1", 10, check)


def test_rerotation_is_exact_where_distances_do_not_change(tiny_model):
    """Without sinks the window is contiguous, so re-rotated and absolute keys give the same attention."""
    ids = prompt(tiny_model, 30)
    cached_keys = {}
    for rerotate in (0, 1):
        cache = step_through(tiny_model, ids, f"streaming_llm:sinks=0,window=8,rerotate={rerotate}", 8)
        keys, _ = cache.layers[1].storage.materialize()
        cached_keys[rerotate] = keys
    assert not torch.equal(cached_keys[0], cached_keys[1])  # keys really were rotated
    # same relative geometry: dot products between cached keys are invariant under a common shift
    dots = {r: k[0, 0] @ k[0, 0].T for r, k in cached_keys.items()}
    torch.testing.assert_close(dots[0], dots[1], rtol=1e-4, atol=1e-4)




def test_rerotated_window_predicts_like_absolute_window(tiny_model):
    """The position shift is right to the token: without sinks both variants must give the same distributions."""
    from kvviz.comparison.session import PromptSession

    session = PromptSession(tiny_model, prompt(tiny_model, 30))
    runs = [session.run(f"streaming_llm:sinks=0,window=8,rerotate={r}", 16, keep_logprobs=True) for r in (0, 1)]
    assert runs[0][0].token_ids == runs[1][0].token_ids
    for absolute, rotated in zip(runs[0][1].step_logprobs, runs[1][1].step_logprobs, strict=True):
        torch.testing.assert_close(absolute, rotated, rtol=1e-4, atol=1e-4)
    with_sinks = [session.run(f"streaming_llm:sinks=4,window=8,rerotate={r}", 16, keep_logprobs=True)[1]
                  for r in (0, 1)]
    assert not torch.allclose(with_sinks[0].step_logprobs[-1], with_sinks[1].step_logprobs[-1])


@pytest.mark.parametrize("spec, message", [
    ("streaming_llm:sinks=-1", "bad value in 'streaming_llm:sinks=-1'"),
    ("streaming_llm:window=x", "bad value"),
    ("streaming_llm:rerotate=2", "bad value"),
    ("streaming_llm:sinks=4,window=0.0", "bad value"),
])
def test_bad_values_give_one_line(spec, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_spec(spec)
    assert "\n" not in str(caught.value)


def test_rerotation_cannot_stack_with_quantization():
    from kvviz.methods import REGISTRY

    quantizers = [name for name, cls in REGISTRY.items() if cls.kind == "quantization"]
    if not quantizers:
        pytest.skip("no quantization method registered")
    with pytest.raises(SpecError, match="rerotate=0"):
        parse_spec(f"streaming_llm+{quantizers[0]}")
    parse_spec(f"streaming_llm:rerotate=0+{quantizers[0]}")


def hamlet_ids(tokenizer, count: int) -> list[int]:
    text = play_text("hamlet")
    return tokenizer(text[text.index("ACT I"):])["input_ids"][:count]


def test_streaming_llm_finding_on_hamlet(real_model):
    """Hamlet Act I, 512 tokens, NLL over positions >= 128 (measured: full 20.4, window 1463, sinks+window 28.8)."""
    ids = hamlet_ids(real_model.tokenizer, 512)
    full = streaming_perplexity(real_model, ids, "full", start=128)
    window = streaming_perplexity(real_model, ids, "window:window=64", start=128)
    sinks = streaming_perplexity(real_model, ids, "streaming_llm:sinks=4,window=60,rerotate=0", start=128)
    assert window.exact and sinks.exact and not full.exact
    assert full.tokens == window.tokens == sinks.tokens == 384
    assert 15 < full.ppl < 26
    assert window.ppl > 500 and window.ppl > 20 * sinks.ppl  # window-only falls apart
    assert sinks.ppl < 1.6 * full.ppl  # sinks + window stay close to full


def test_rotating_keys_by_a_delta_matches_the_model_rotating_them_there(tiny_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvviz.cache.rotation import rope_rotator

    rotary = tiny_model.model.model.rotary_emb
    keys = torch.randn(1, 2, 5, tiny_model.model.config.head_dim)
    start, moved = torch.tensor([[3, 9, 20, 21, 40]]), torch.tensor([[1, 2, 3, 4, 5]])
    cos, sin = rotary(keys, start)
    at_start, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    cos, sin = rotary(keys, moved)
    at_moved, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    delta = (moved - start).view(1, 1, 5).expand(1, 2, 5)
    rotator = rope_rotator(tiny_model.model)
    rotated = rotator.apply(at_start, *rotator.angles(delta, at_start.dtype))
    torch.testing.assert_close(rotated, at_moved, rtol=1e-5, atol=1e-5)
