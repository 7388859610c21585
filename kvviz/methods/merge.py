"""Merging instead of dropping (the merging family: CaM, D2O, KVMerger): SnapKV's selection, then every evicted
token's key and value are folded into the kept token of the same KV head whose key is most similar (cosine).

The fold is a weighted mean, weighted by the attention each token received from the observation window (the same
votes SnapKV ranks by): ``k_i' = (a_i k_i + sum_j a_j k_j) / (a_i + sum_j a_j)`` over the evicted ``j`` assigned to
kept ``i``, and the same for values. The cache holds exactly as many entries as ``snapkv`` at the same parameters,
so ``merge`` against ``snapkv`` shows what merging buys at the same bytes. Keys are merged after RoPE, as they are
cached. Prefill only, like SnapKV; the merged entries are stored afresh in the stack's format (quantized too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvviz.cache.protocol import LayerView, per_kv_head
from kvviz.cache.spec import register
from kvviz.cache.storage import MergedKeep, gather_tokens
from kvviz.methods.snapkv import SnapKV

WEIGHT_FLOOR = 1e-6  # tokens the window ignored still count a little, so no weighted mean divides by zero


def nearest_survivor(keys: torch.Tensor, survivor_keys: torch.Tensor) -> torch.Tensor:
    """For each key [..., T, D], the index [..., T] of the survivor key [..., n, D] most similar to it (cosine): the
    rule merging uses to say where an evicted token goes (here, and when reading what a kvpress merging press did)."""
    return (F.normalize(keys.float(), dim=-1) @ F.normalize(survivor_keys.float(), dim=-1).transpose(-1, -2)).argmax(-1)


def merge_into_nearest(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H, n, D] of the ``kept`` entries [B, H, n] after folding every other entry into its most
    similar kept key (cosine, same head), weighted by ``weights`` [B, H, T]."""
    batch, heads, length, dim = keys.shape
    is_kept = torch.zeros(batch, heads, length, dtype=torch.bool, device=keys.device).scatter_(-1, kept, True)
    target = nearest_survivor(keys, gather_tokens(keys, kept))  # [B, H, T]: the kept slot each entry folds into
    slot = torch.zeros_like(target).scatter_(-1, kept, torch.arange(kept.shape[-1], device=keys.device).expand_as(kept))
    target = torch.where(is_kept, slot, target)  # kept entries stay in their own slot
    weight = weights.float().clamp_min(WEIGHT_FLOOR).unsqueeze(-1)  # [B, H, T, 1]
    total = torch.zeros(batch, heads, kept.shape[-1], 1, device=keys.device).scatter_add_(2, target.unsqueeze(-1),
                                                                                          weight)
    merged = []
    for x in (keys, values):
        summed = torch.zeros(batch, heads, kept.shape[-1], dim, device=keys.device)
        summed.scatter_add_(2, target.unsqueeze(-1).expand(-1, -1, -1, dim), x.float() * weight)
        merged.append((summed / total).to(x.dtype))
    return merged[0], merged[1]


@register
class Merge(SnapKV):
    name = "merge"
    stacks_with_architecture = False
    why_not_with_architecture = "rebuilds merged K/V per model head, which an architecture's stored form cannot take"
    summary = ("SnapKV's selection, then each evicted token's K and V merged into the most similar kept key of its "
               "head, weighted by the window's attention: the same bytes as snapkv, nothing simply dropped.")

    def prefill_select(self, view: LayerView, stats) -> MergedKeep | None:
        kept = super().prefill_select(view, stats)
        if kept is None:
            return None
        batch, kv_heads, _ = view.positions.shape
        window_sum = stats.window_attention[self.window][view.layer_idx]
        received = per_kv_head(window_sum.float().unsqueeze(0) / self.window, kv_heads, mean=True)
        keys, values = view.entries()
        merged_keys, merged_values = merge_into_nearest(keys, values, kept, received.expand(batch, -1, -1).to(
            keys.device))
        return MergedKeep(kept, merged_keys, merged_values)
