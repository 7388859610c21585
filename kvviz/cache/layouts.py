"""What a serving engine would hold for the same kept tokens: KV bytes under real cache layouts.

kvviz counts exactly the tensors it holds (``counted``). An engine stores the cache in a layout, and a token a method
dropped frees memory only when the layout can give its slot back:

- ``dense_per_layer``: one dense tensor per layer, every KV head padded to the layer's longest head (a
  DynamicCache-style engine), so head-wise budgets (AdaKV) save only what the longest head does not keep;
- ``paged_shared``: blocks of ``block_size`` token slots shared by every layer and KV head (vLLM's block table), a
  block freed only when no layer and no head keeps any of its tokens;
- ``paged_shared_compacted``: the same after compaction: the union of kept tokens over layers and heads packed into
  whole blocks;
- ``paged_per_head``: each layer and KV head packs its own kept tokens into its own blocks (KV-Compress-style).

Everything follows from the eviction ledger's kept mask and the bytes each layer's storage holds (codes, metadata
and full-precision parts): a layer's bytes per kept (head, token) slot is its bytes over its kept slots, so a
quantized storage's slots cost what its codes and metadata cost. One vectorized pass over ``[layers, heads, tokens]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvviz.cache.ledger import KEPT, EvictionLedger

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size (token slots per block)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)  # the pages' choices: 1 is no paging loss, 8-32 what vLLM's kernels take
LAYOUTS = ("counted", "dense_per_layer", "paged_shared", "paged_shared_compacted", "paged_per_head")
MEANINGS = {
    "counted": "the tensors kvviz holds: codes, metadata and full-precision parts of every kept entry",
    "dense_per_layer": "one dense tensor per layer: every KV head padded to the layer's longest head",
    "paged_shared": "blocks of B token slots shared by all layers and heads: a block frees only when nobody keeps "
                    "any of its tokens",
    "paged_shared_compacted": "the same blocks after compaction: the union of kept tokens packed into whole blocks",
    "paged_per_head": "blocks of B slots per layer and KV head (KV-Compress): each head packs its own kept tokens",
}
LABELS = {
    "counted": "counted",
    "dense_per_layer": "dense per layer",
    "paged_shared": "paged, shared blocks",
    "paged_shared_compacted": "paged, compacted",
    "paged_per_head": "paged per head",
}


@dataclass(frozen=True)
class LayoutBytes:
    """Bytes one cache would hold in each layout, for blocks of ``block_size`` token slots."""

    block_size: int
    counted: int
    dense_per_layer: int
    paged_shared: int
    paged_shared_compacted: int
    paged_per_head: int

    def to_json(self) -> dict[str, int]:
        """The five layouts by name (the block size travels once, at the top of a report)."""
        return {name: value for name, value in asdict(self).items() if name != "block_size"}

    def freed(self, full: LayoutBytes) -> dict[str, float]:
        """The share of the full cache each layout frees: 1 - these bytes / full's bytes in the same layout."""
        return {name: 1 - getattr(self, name) / getattr(full, name) if getattr(full, name) else 0.0
                for name in LAYOUTS}


def compression_in(layout: str, held: dict[str, int] | None, full: dict[str, int] | None) -> float | None:
    """How many times smaller than the full cache a configuration is in ``layout`` (full's bytes in the same
    layout over its own), from two ``layout_bytes`` dicts; None where either is missing."""
    if not held or not full or not held.get(layout):
        return None
    return full[layout] / held[layout]


def check_block_size(block_size: int) -> int:
    """``block_size`` itself, or ValueError: a block holds at least one token slot."""
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block size {block_size!r} must be a whole number of token slots, at least 1")
    return int(block_size)


def layout_bytes(kept: torch.Tensor, layer_bytes: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> LayoutBytes:
    """The layouts of a cache whose ``kept`` [layers, kv_heads, tokens] mask says which slots each layer and head
    holds, and whose layer ``l`` holds ``layer_bytes[l]`` bytes in all (``counted`` is their sum, exactly).

    A layer that keeps no slot but holds bytes (a storage of merged or latent entries only) is held as it is in
    every layout."""
    block = check_block_size(block_size)
    kept = kept.to(torch.bool)
    layers, heads, tokens = kept.shape
    held = torch.tensor([float(b) for b in layer_bytes], dtype=torch.float64)
    if held.numel() != layers:
        raise ValueError(f"{held.numel()} layers of bytes for a mask of {layers} layers")
    counts = kept.sum(dim=-1).to(torch.float64)  # [L, H]
    slots = counts.sum(dim=-1)  # [L]
    per_slot = torch.where(slots > 0, held / slots.clamp(min=1), torch.zeros_like(held))
    unslotted = float(held[slots == 0].sum())  # bytes no kept slot accounts for
    token_bytes = float((per_slot * heads).sum())  # one token slot in every layer and head
    blocks = -(-tokens // block)
    union = torch.zeros(blocks * block, dtype=torch.bool)
    union[:tokens] = kept.reshape(layers * heads, tokens).any(dim=0)
    live_blocks = int(union.view(blocks, block).any(dim=-1).sum())
    union_blocks = -(-int(union.sum()) // block)
    per_head_slots = torch.ceil(counts / block) * block  # [L, H]
    return LayoutBytes(
        block_size=block,
        counted=round(float(held.sum())),
        dense_per_layer=round(float((counts.max(dim=-1).values * heads * per_slot).sum()) + unslotted),
        paged_shared=round(live_blocks * block * token_bytes + unslotted),
        paged_shared_compacted=round(union_blocks * block * token_bytes + unslotted),
        paged_per_head=round(float((per_head_slots.sum(dim=-1) * per_slot).sum()) + unslotted),
    )


def cache_layouts(ledger: EvictionLedger | None, layer_bytes: Sequence[int], total_tokens: int,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> LayoutBytes:
    """The layouts of a finished run: the ledger's tokens still cached at the end (``total_tokens`` tokens fed),
    or, with no ledger (nothing evicted: a full or quantized cache), every token of every layer (one mask row per
    layer is enough: each layout then holds the layer's bytes, rounded up to whole blocks where it pages)."""
    if ledger is None:
        kept = torch.ones(len(layer_bytes), 1, total_tokens, dtype=torch.bool)
    else:
        kept = ledger.evicted_at[..., :total_tokens] == KEPT
    return layout_bytes(kept, layer_bytes, block_size)


def layouts_by_layer_type(ledger: EvictionLedger | None, layer_bytes: Sequence[int], total_tokens: int,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, LayoutBytes]:
    """Each layer type's layouts (``global``, ``local W``) for a model with local layers, empty for one without.

    A type's ``paged_shared`` is a block pool shared by that type's layers only, which is how an engine with a
    pool per attention type (vLLM's hybrid allocator) frees a local layer's blocks once its window has passed them;
    one pool for every layer (the whole cache's ``paged_shared``) keeps them while any global layer keeps the token.
    """
    if ledger is None or not any(ledger.windows):
        return {}
    kinds = ledger.layer_kinds()
    kept = ledger.evicted_at[..., :total_tokens] == KEPT
    layouts = {}
    for kind in dict.fromkeys(kinds):
        layers = [index for index, name in enumerate(kinds) if name == kind]
        layouts[kind] = layout_bytes(kept[layers], [layer_bytes[index] for index in layers], block_size)
    return layouts
