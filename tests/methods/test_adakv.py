"""adakv: one budget per layer spread across heads by score; agrees with kvpress's AdaKVPress on the real model."""

from __future__ import annotations

import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import parse_spec
from kvviz.methods.kvpress.adakv import adaptive_keep
from kvviz.runtime.replay import forward_step
from tests.methods.kvpress_reference import overlaps, run_press
from tests.methods.test_window import prompt


def kvpress_adakv_indices(loaded, ids: list[int], ratio: float) -> dict[int, list[torch.Tensor]]:
    """Per layer and KV head, the entries kvpress's AdaKVPress(SnapKVPress()) leaves unmasked."""
    from kvpress import AdaKVPress, SnapKVPress

    kept: dict[int, list[torch.Tensor]] = {}

    class Recording(AdaKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            super().compress(module, hidden_states, keys, values, attentions, kwargs)
            _, heads, seq = module.masked_key_indices
            masked = torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.bool)
            masked[heads, seq] = True
            kept[module.layer_idx] = [torch.nonzero(~row).flatten() for row in masked]
            module.masked_key_indices = None  # leave the model as it was
            return keys, values

    run_press(loaded, ids, Recording(SnapKVPress(compression_ratio=ratio)))
    return kept


def test_matches_kvpress_adakv_on_the_real_model(real_model, long_story_ids):
    reference = kvpress_adakv_indices(real_model, long_story_ids, 0.5)
    cache = PromptSession(real_model, long_story_ids).fork(parse_spec("adakv:ratio=0.5"))
    counts = [len(set(row.tolist())) for layer in range(30) for row in cache.kept_positions(layer)]
    assert len(set(counts)) > 1  # heads really keep different numbers
    assert [sum(counts[3 * layer:3 * layer + 3]) for layer in range(30)] == [3 * 260] * 30  # one budget per layer
    shares = overlaps(cache, reference)
    assert len(shares) == 30 * 3
    assert min(shares) >= 0.99, f"worst head overlap {min(shares):.3f}"


def test_safeguard_keeps_every_heads_top_entries():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0] = torch.arange(10) + 100.0  # head 0 outscores head 1 everywhere
    scores[0, 1] = torch.arange(10).float()
    keep = adaptive_keep(scores, per_head=5, alpha=0.4)
    assert keep[0, 1].sum() == 2 and keep[0, 1, 8:].all()  # head 1 keeps its reserved top 2
    assert keep[0, 0].sum() == 8
    assert adaptive_keep(scores, per_head=5, alpha=0)[0, 1].sum() == 0


def test_padding_is_masked_out_exactly_as_if_the_dropped_entries_were_masked(tiny_model):
    """A compressed, padded cache gives the same next logits as the full cache with the dropped entries masked."""
    ids = prompt(tiny_model, 60)
    session = PromptSession(tiny_model, ids)
    token = int(session.prefill().last_logits.argmax())
    compressed = session.fork(parse_spec("adakv:press=knorm,ratio=0.5,alpha=0.2"))
    assert any(layer.padding is not None for layer in compressed.layers)
    masked = session.fork(parse_spec("full"))
    for source, target in zip(compressed.layers, masked.layers, strict=True):
        kept = torch.zeros(target.positions.shape, dtype=torch.bool).scatter_(-1, source.positions, True)
        target.padding = ~kept
    plain = session.fork(parse_spec("full"))
    with torch.inference_mode():
        ours, reference, unmasked = (forward_step(tiny_model.model, cache, [token], 60, 1, "cpu")
                                     for cache in (compressed, masked, plain))
    assert torch.allclose(ours, reference, atol=1e-5)
    assert not torch.allclose(ours, unmasked, atol=1e-3)


def test_bytes_count_valid_entries_and_one_length_per_head(tiny_model):
    ids = prompt(tiny_model, 60)
    result, _ = PromptSession(tiny_model, ids).run("adakv:press=knorm,ratio=0.5", 3)
    kept = int(result.ledger.kept_mask(0, 60).sum())  # valid entries after prefill, all layers and heads
    per_entry = 2 * 16 * 4  # K and V, head_dim 16, float32
    fed = 2 * 2 * 2  # 2 fed tokens x 2 layers x 2 heads
    assert kept == 2 * 2 * 30  # one budget per layer: 2 heads x 30
    padded_layers = 2  # knorm on random weights gives unequal heads in both layers
    assert result.kv_bytes == (kept + fed) * per_entry + padded_layers * 2 * 4
    assert result.kv_breakdown.metadata == padded_layers * 2 * 4


def test_stacks_with_quantizers_discounting_padding_only_where_entries_cost_the_same(tiny_model):
    session = PromptSession(tiny_model, prompt(tiny_model, 60))
    fp8, _ = session.run("adakv:press=knorm+fp8:scale=head", 3)
    kept = int(fp8.ledger.kept_mask(0, 60).sum()) + 2 * 2 * 2
    assert fp8.kv_breakdown.codes == kept * 2 * 16  # one byte per valid element
    kivi, _ = session.run("adakv:press=knorm+kivi:group=8,residual=8", 3)
    cache = session.fork(parse_spec("adakv:press=knorm+kivi:group=8,residual=8"))
    assert kivi.error is None
    assert cache.nbytes().total == sum(layer.storage.nbytes().total for layer in cache.layers)  # padding counted
