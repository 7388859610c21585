"""Layout bytes on constructed ledgers: what each serving layout would hold for the same kept tokens."""

from __future__ import annotations

import pytest
import torch

from kvviz.cache.layouts import LAYOUTS, cache_layouts, layout_bytes
from kvviz.cache.ledger import EvictionLedger

LAYERS, HEADS, TOKENS, BLOCK = 4, 2, 160, 16
SLOT = 64  # bytes per (layer, head, token) slot of a full-precision toy cache


def bytes_of(kept: torch.Tensor, slot: int = SLOT) -> list[int]:
    """What each layer of a toy storage holds: ``slot`` bytes per kept (head, token) slot."""
    return [int(layer.sum()) * slot for layer in kept]


def layouts(kept: torch.Tensor, block: int = BLOCK, slot: int = SLOT):
    return layout_bytes(kept, bytes_of(kept, slot), block)


def full_mask(tokens: int = TOKENS) -> torch.Tensor:
    return torch.ones(LAYERS, HEADS, tokens, dtype=torch.bool)


def scattered(seed: int, share: float, heads: int = 1) -> torch.Tensor:
    """A random ``share`` of the tokens per head (the same in every layer, ``heads`` distinct choices)."""
    generator = torch.Generator().manual_seed(seed)
    choice = torch.rand(heads, TOKENS, generator=generator) < share
    return choice.expand(HEADS, TOKENS).unsqueeze(0).expand(LAYERS, HEADS, TOKENS).clone() if heads == 1 else \
        choice.unsqueeze(0).expand(LAYERS, HEADS, TOKENS).clone()


def test_same_tokens_in_every_head_make_dense_equal_counted():
    kept = torch.zeros(LAYERS, HEADS, TOKENS, dtype=torch.bool)
    kept[..., ::3] = True
    result = layouts(kept)
    assert result.dense_per_layer == result.counted == int(kept.sum()) * SLOT


def test_heads_keeping_disjoint_halves_pad_a_dense_layer():
    kept = torch.zeros(LAYERS, HEADS, TOKENS, dtype=torch.bool)
    kept[:, 0, : TOKENS // 2] = True
    kept[:, 1, TOKENS // 2 + 8:] = True  # the second head keeps fewer: the layer pads it to the first's length
    result = layouts(kept)
    assert result.dense_per_layer > result.counted
    assert result.dense_per_layer == LAYERS * HEADS * (TOKENS // 2) * SLOT


def test_a_contiguous_window_frees_whole_blocks():
    kept = torch.zeros(LAYERS, HEADS, TOKENS, dtype=torch.bool)
    kept[..., :4] = True  # sinks
    kept[..., 100:] = True  # the window
    result = layouts(kept)
    token_bytes = LAYERS * HEADS * SLOT
    assert result.counted <= result.paged_shared <= result.counted + 2 * BLOCK * token_bytes
    assert result.paged_shared == (1 + 4) * BLOCK * token_bytes  # block 0 (sinks), blocks 6..9 (the window)


def test_scattered_keeps_shared_by_every_head_keep_blocks_alive_until_compacted():
    kept = scattered(0, 0.25)
    result, full = layouts(kept), layouts(full_mask())
    token_bytes = LAYERS * HEADS * SLOT
    assert result.counted < 0.35 * full.counted
    assert result.paged_shared >= 0.9 * full.paged_shared
    assert result.counted <= result.paged_shared_compacted < result.counted + BLOCK * token_bytes


def test_scattered_keeps_that_differ_per_head_compact_to_their_union():
    kept = scattered(1, 0.25, heads=HEADS)
    result = layouts(kept)
    union = int(kept.any(dim=0).any(dim=0).sum())
    token_bytes = LAYERS * HEADS * SLOT
    assert result.paged_shared_compacted == -(-union // BLOCK) * BLOCK * token_bytes
    assert result.paged_shared_compacted > result.counted  # the union is larger than any one head's share
    counts = kept.sum(dim=-1)
    assert result.paged_per_head == int((torch.ceil(counts / BLOCK) * BLOCK).sum()) * SLOT


@pytest.mark.parametrize("tokens", [TOKENS, TOKENS + 5, 7])
def test_the_full_cache_is_counted_rounded_up_to_whole_blocks(tokens):
    kept = full_mask(tokens)
    result = layouts(kept)
    rounded = -(-tokens // BLOCK) * BLOCK * LAYERS * HEADS * SLOT
    assert result.dense_per_layer == result.counted
    assert result.paged_shared == result.paged_shared_compacted == result.paged_per_head == rounded


@pytest.mark.parametrize("seed", range(6))
def test_every_layout_lies_between_counted_and_full(seed):
    generator = torch.Generator().manual_seed(seed)
    kept = torch.rand(LAYERS, HEADS, TOKENS, generator=generator) < 0.1 * (seed + 1)
    result, full = layouts(kept), layouts(full_mask())
    for name in LAYOUTS:
        assert result.counted <= getattr(result, name) <= getattr(full, name), name


def test_a_quantized_storage_costs_its_own_bytes_per_slot():
    """A layer's slots cost what its storage holds per slot: a 4x smaller storage gives 4x smaller layouts."""
    kept = scattered(2, 0.5)
    dense, quantized = layouts(kept, slot=64), layouts(kept, slot=16)
    for name in LAYOUTS:
        assert getattr(dense, name) == 4 * getattr(quantized, name), name


def test_a_layer_with_bytes_but_no_slots_is_held_in_every_layout():
    kept = full_mask()
    kept[0] = False
    held = bytes_of(kept)
    held[0] = 1000  # merged or latent entries the ledger does not list
    result = layout_bytes(kept, held, BLOCK)
    assert result.counted == sum(held)
    assert all(getattr(result, name) >= 1000 for name in LAYOUTS)


def test_the_ledger_gives_the_tokens_cached_at_the_end():
    ledger = EvictionLedger.empty(LAYERS, HEADS, 100, 120)
    ledger.record(0, 0, torch.tensor([[1, 2], [3, 4]]))
    ledger.record(1, 3, torch.tensor([[5], [6]]))
    result = cache_layouts(ledger, [SLOT * (2 * 110 - 4), SLOT * (2 * 110 - 2), SLOT * 220, SLOT * 220], 110, BLOCK)
    assert result.counted == SLOT * (8 * 110 - 6)
    assert result.dense_per_layer == result.counted  # both heads of a layer dropped as many
    assert result.paged_shared == 112 * 2 * LAYERS * SLOT  # another head still holds every dropped token
    assert cache_layouts(None, [SLOT * 220] * LAYERS, 110, BLOCK).paged_shared == 112 * 2 * LAYERS * SLOT


def test_a_block_holds_at_least_one_slot():
    with pytest.raises(ValueError, match="block size"):
        layouts(full_mask(), block=0)


def test_the_share_freed_is_read_against_full_in_the_same_layout():
    kept = torch.zeros(LAYERS, HEADS, TOKENS, dtype=torch.bool)
    kept[..., TOKENS // 2:] = True
    freed = layouts(kept).freed(layouts(full_mask()))
    assert freed["counted"] == freed["paged_shared"] == freed["paged_per_head"] == 0.5


@pytest.mark.slow
def test_on_the_real_model_a_2k_prompt_shows_what_each_layout_eats(real_model):
    """The issue's acceptance on SmolLM2 (30 layers x 3 KV heads), hamlet's first 2,000 tokens, blocks of 16."""
    from kvviz.comparison.session import compare
    from kvviz.studies.perplexity import play_text

    ids = real_model.tokenizer(play_text("hamlet"))["input_ids"][:2000]
    comparison = compare(real_model, ids, ["full", "snapkv:budget=0.25", "streaming_llm:window=0.25",
                                           "adakv:ratio=0.75"], 1)
    held = comparison.layouts(16)
    full = held["full"]
    snapkv, window, adakv = held["snapkv:budget=0.25"], held["streaming_llm:window=0.25"], held["adakv:ratio=0.75"]
    assert snapkv.counted < 0.3 * full.counted and snapkv.paged_shared >= 0.8 * full.paged_shared
    assert window.paged_shared <= 1.1 * window.counted
    assert adakv.dense_per_layer > adakv.counted


def test_local_layers_free_their_blocks_only_in_a_pool_of_their_own():
    """Three local layers of window 33 (32 tokens held) and a global one, a full cache of 160 tokens: one block pool
    for every layer keeps the local layers' old blocks while the global layer holds the tokens; a pool per layer type
    (the ``by layer type`` layouts) frees them."""
    from kvviz.cache.layouts import layouts_by_layer_type

    ledger = EvictionLedger.empty(LAYERS, HEADS, TOKENS, TOKENS, windows=(33, 33, 33, None))
    ledger.evicted_at[:3, :, :TOKENS - 32] = 0  # what each local layer's window slid past
    kept = ledger.evicted_at == -1
    whole = cache_layouts(ledger, bytes_of(kept), TOKENS, BLOCK)
    by_type = layouts_by_layer_type(ledger, bytes_of(kept), TOKENS, BLOCK)
    assert list(by_type) == ["local 33", "global"] and ledger.slid_out(TOKENS)[:3, :, :TOKENS - 32].all()
    assert whole.counted == sum(layouts.counted for layouts in by_type.values()) == SLOT * HEADS * (3 * 32 + TOKENS)
    assert whole.paged_shared == SLOT * HEADS * LAYERS * TOKENS  # every block stays: the global layer keeps it
    assert by_type["local 33"].paged_shared == SLOT * HEADS * 3 * 32 and by_type["global"].paged_shared == (
        SLOT * HEADS * TOKENS)
    assert layouts_by_layer_type(EvictionLedger.empty(LAYERS, HEADS, TOKENS, TOKENS), bytes_of(kept), TOKENS) == {}
