"""snapkv: prefill-time selection per KV head; agrees with kvpress's SnapKVPress on the real model."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from tests.methods.test_window import prompt


def kvpress_snapkv_indices(loaded, ids: list[int], ratio: float) -> dict[int, torch.Tensor]:
    """Per layer, the indices kvpress's own SnapKVPress keeps (window 64, kernel 5, avg), sorted per head."""
    from kvpress import SnapKVPress
    from transformers import DynamicCache

    kept: dict[int, torch.Tensor] = {}

    class Recording(SnapKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            count = int(keys.shape[2] * (1 - self.compression_ratio))
            kept[module.layer_idx] = scores.topk(count, dim=-1).indices.sort(dim=-1).values[0]
            return keys, values

    with torch.inference_mode(), Recording(compression_ratio=ratio, window_size=64, kernel_size=5)(loaded.model):
        loaded.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=loaded.config))
    return kept


def test_matches_kvpress_snapkv_on_the_real_model(real_model, story_ids):
    ratio = 0.5
    budget = int(len(story_ids) * (1 - ratio))
    reference = kvpress_snapkv_indices(real_model, story_ids, ratio)
    cache = PromptSession(real_model, story_ids).fork(parse_spec(f"snapkv:budget={budget},window=64,kernel=5,pool=avg"))
    overlaps = []
    for layer, expected in reference.items():
        ours = cache.kept_positions(layer)
        for head in range(ours.shape[0]):
            overlaps.append(len(set(ours[head].tolist()) & set(expected[head].tolist())) / budget)
    assert len(overlaps) == 30 * 3
    assert min(overlaps) >= 0.99, f"worst head overlap {min(overlaps):.3f}"


def test_window_always_kept_and_budget_respected(tiny_model):
    ids = prompt(tiny_model, 60)
    session = PromptSession(tiny_model, ids)
    cache = session.fork(parse_spec("snapkv:budget=20,window=8"))
    for layer in range(2):
        kept = cache.kept_positions(layer)
        assert kept.shape == (2, 20)
        assert all(set(range(52, 60)) <= set(row.tolist()) for row in kept)
    result, _ = session.run("snapkv:budget=20,window=8", 5)
    assert result.ledger.evicted_at[0, 0, :60].eq(0).sum() == 40  # evicted at prefill only
    assert result.ledger.evicted_at.max() == 0


@pytest.mark.parametrize("spec, message", [
    ("snapkv:budget=16,window=32", "must exceed the observation window 32"),
    ("snapkv:kernel=4", "kernel must be odd"),
    ("snapkv:pool=mean", "choose max|avg"),
    ("snapkv:budget=-2", "bad value"),
])
def test_bad_values_give_one_line(spec, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_spec(spec)
    assert "\n" not in str(caught.value)


def test_window_longer_than_prompt_is_reported(tiny_model):
    session = PromptSession(tiny_model, prompt(tiny_model, 20))
    with pytest.raises(SpecError, match="window 32 is not shorter than the prompt"):
        session.fork(parse_spec("snapkv:budget=0.5"))
