"""decoding: compress back to a target every n generated steps; agrees with kvpress's DecodingPress."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from kvviz.runtime.replay import forward_step
from tests.methods.test_window import prompt


def kvpress_decoding_positions(loaded, prompt_ids: list[int], fed: list[int], every: int, target: int):
    """Absolute positions each layer and KV head holds after feeding ``fed`` under DecodingPress(KnormPress)."""
    from kvpress import DecodingPress, KnormPress
    from transformers import DynamicCache

    heads = loaded.config.num_key_value_heads
    held = {layer: torch.arange(len(prompt_ids)).expand(heads, -1) for layer in range(loaded.config.num_hidden_layers)}
    rounds: list[int] = []
    now = {"position": 0}

    class RecordingKnorm(KnormPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            count = int(keys.shape[2] * (1 - self.compression_ratio))
            if count < keys.shape[2]:
                chosen = scores.topk(count, dim=-1).indices[0]  # kvpress gathers in this (score) order
                held[module.layer_idx] = held[module.layer_idx].gather(-1, chosen)
                if module.layer_idx == 0:
                    rounds.append(now["position"])
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    class Tracking(DecodingPress):
        def forward_hook(self, module, input, kwargs, output):
            if kwargs["hidden_states"].shape[1] == 1:
                layer = module.layer_idx
                held[layer] = torch.cat([held[layer], torch.full((heads, 1), now["position"])], -1)
            return super().forward_hook(module, input, kwargs, output)

    cache = DynamicCache(config=loaded.config)
    with torch.inference_mode(), Tracking(RecordingKnorm(), compression_interval=every, target_size=target)(
            loaded.model):
        loaded.model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache)
        for step, token in enumerate(fed):
            now["position"] = len(prompt_ids) + step
            length = cache.get_seq_length()
            loaded.model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                         position_ids=torch.tensor([[now["position"]]]), cache_position=torch.tensor([length]))
    return held, rounds


def test_matches_kvpress_decoding_press_on_the_real_model(real_model, hamlet_ids):
    prompt_ids, fed = hamlet_ids[:500], hamlet_ids[500:520]
    every, target = 8, 400
    reference, rounds = kvpress_decoding_positions(real_model, prompt_ids, fed, every, target)
    assert len(rounds) == 2
    session = PromptSession(real_model, prompt_ids)
    cache = session.fork(parse_spec(f"decoding:press=knorm,every={every},target={target}"))
    with torch.inference_mode():
        for step, token in enumerate(fed, start=1):
            forward_step(real_model.model, cache, [token], len(prompt_ids) + step - 1, step, "cpu")
    shares = []
    for layer, expected in reference.items():
        ours = cache.kept_positions(layer)
        assert ours.shape == expected.shape
        for head in range(ours.shape[0]):
            shares.append(len(set(ours[head].tolist()) & set(expected[head].tolist())) / expected.shape[-1])
    assert len(shares) == 30 * 3
    # the first layer's keys depend on the token alone and RoPE keeps norms, so every repeat of "." ties under knorm
    # there; decoding breaks ties in DecodingPress's cache order (its last round's score order, then new tokens),
    # which position order got wrong on 1.5% of a head's entries
    assert min(shares) == 1.0, f"worst head overlap {min(shares):.3f} (first layer {min(shares[:3]):.3f})"
    steps = set(cache.ledger.evicted_at.unique().tolist()) - {-1}
    assert steps == {9, 17}  # both rounds, recorded as the next token arrives


def test_every_round_cuts_back_to_the_target_and_the_ledger_records_it(tiny_model):
    ids = prompt(tiny_model, 40)
    result, _ = PromptSession(tiny_model, ids).run("decoding:every=5,target=30", 13)
    ledger = result.ledger.evicted_at
    assert set(ledger.unique().tolist()) == {-1, 6, 11}
    assert int((ledger[0, 0] == 6).sum()) == 40 + 5 - 30  # prompt + 5 fed tokens cut to 30 as the 6th arrives
    assert int((ledger[0, 0] == 11).sum()) == 5
    assert bool((ledger[:, :, 45] != 6).all())  # the arriving token survives its own round
    sizes = result.kv_bytes_per_step
    per_token = 2 * 2 * 2 * 16 * 4  # layers x heads x K,V x dim x fp32
    assert [sizes[s] // per_token for s in (5, 6, 10, 11)] == [45, 31, 35, 31]
    assert result.kv_bytes == (30 + 2) * per_token  # 12 tokens fed: the last round kept 30 + 1, then 1 more


def test_the_prompt_is_left_whole(tiny_model):
    cache = PromptSession(tiny_model, prompt(tiny_model, 40)).fork(parse_spec("decoding:target=8"))
    assert cache.kept_positions(0).shape[-1] == 40


def test_only_cache_only_scorers_are_offered():
    with pytest.raises(SpecError, match="choose knorm|keydiff|lagkv|random"):
        parse_spec("decoding:press=snapkv")
