"""pyramidkv: layer budgets falling linearly over the layers; agrees with kvpress's PyramidKVPress on the real model."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from kvviz.methods.kvpress.pyramidkv import pyramid_kept
from tests.methods.kvpress_reference import overlaps, run_press
from tests.methods.test_window import prompt


def kvpress_pyramid_indices(loaded, ids: list[int], ratio: float) -> dict[int, list[torch.Tensor]]:
    from kvpress import PyramidKVPress

    kept: dict[int, list[torch.Tensor]] = {}

    class Recording(PyramidKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            count = self.get_layer_budget(module, keys.shape[2])
            kept[module.layer_idx] = list(scores.topk(count, dim=-1).indices.sort(dim=-1).values[0])
            return keys, values

    run_press(loaded, ids, Recording(compression_ratio=ratio))
    return kept


def test_matches_kvpress_pyramidkv_on_the_real_model(real_model, long_story_ids):
    reference = kvpress_pyramid_indices(real_model, long_story_ids, 0.5)
    cache = PromptSession(real_model, long_story_ids).fork(parse_spec("pyramidkv:ratio=0.5"))
    counts = [cache.kept_positions(layer).shape[-1] for layer in range(30)]
    assert counts == [reference[layer][0].numel() for layer in range(30)]
    assert counts[0] > counts[-1]  # a pyramid
    shares = overlaps(cache, reference)
    assert len(shares) == 30 * 3
    assert min(shares) >= 0.99, f"worst head overlap {min(shares):.3f}"


def test_total_matches_a_uniform_budget_and_falls_linearly():
    counts = [pyramid_kept(1000, layer, 30, 0.5, 8, 20) for layer in range(30)]
    assert abs(sum(counts) - 30 * 500) <= 30  # rounding, one token per layer at most
    steps = {counts[i] - counts[i + 1] for i in range(29)}
    assert max(steps) - min(steps) <= 1 and min(steps) > 0
    assert counts[-1] == pytest.approx(500 / 20, abs=1)
    capped = [pyramid_kept(1000, layer, 30, 0.5, 64, 20) for layer in range(30)]
    assert capped[0] == 1000 - 64 and capped[-1] == 64  # the bottom layer cannot keep more than the prompt


def test_falls_back_to_a_uniform_budget_when_the_pyramid_does_not_fit():
    assert pyramid_kept(100, 0, 30, 0.9, 64, 20) == 10  # the top layer would keep less than the window


def test_bytes_are_kept_tokens_times_per_token_bytes(tiny_model):
    ids = prompt(tiny_model, 120)
    session = PromptSession(tiny_model, ids)
    result, _ = session.run("pyramidkv:ratio=0.5,window=8", 3)
    kept = result.ledger.kept_mask(0, 120).sum(-1)  # [layers, heads] after prefill
    per_token = 2 * 16 * 4  # K and V, head_dim 16, float32
    assert kept[0, 0] > kept[1, 0]
    assert result.kv_bytes == int(kept.sum() + 2 * 2 * 2) * per_token  # + 2 fed tokens per layer and head


def test_window_not_shorter_than_the_prompt_is_reported(tiny_model):
    with pytest.raises(SpecError, match="window 64 is not shorter than the prompt"):
        PromptSession(tiny_model, prompt(tiny_model, 40)).fork(parse_spec("pyramidkv"))
