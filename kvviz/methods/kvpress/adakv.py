"""AdaKV (Feng et al. 2024): head-adaptive budgets. One budget per layer, spread across its KV heads by score.

A uniform method keeps ``n = int(N * (1 - ratio))`` entries in every head. AdaKV pools the layer's ``H * n`` slots
and hands them to the highest scores of any head, so heads whose attention is concentrated give slots to heads
whose attention is spread. A safeguard first reserves each head's top ``alpha * n`` entries (kvpress's
``alpha_safeguard``), so no head is emptied. Scores come from a kvpress scorer (SnapKV's window votes by default).

How unequal counts are held: kvpress keeps every entry and masks the evicted ones out of attention. kvviz drops
them: each head's kept entries are stored in one padded tensor (as wide as the fullest head), the padding slots are
masked out of attention, and ``kv_bytes`` counts the valid entries plus one int32 length per head, which is what a
varlen layout such as AdaKV's flattened heads holds. That holds for storages whose entries each cost the same
(dense, fp8, bnb); group quantizers (kivi, per_token) store the padding rows inside their groups, so there the padded
layout is what is counted.
"""

from __future__ import annotations

import torch

from kvviz.cache.protocol import LayerView
from kvviz.cache.spec import Param, register
from kvviz.cache.storage import RaggedKeep
from kvviz.methods.kvpress.scorer import KVPressScorer, press_param


def adaptive_keep(scores: torch.Tensor, per_head: int, alpha: float) -> torch.Tensor:
    """Bool mask [B, H, T] of the entries kept: the layer's ``H * per_head`` best scores across heads, after each
    head's top ``int(alpha * per_head)`` (at least one when ``alpha`` > 0) are reserved."""
    batch, heads, length = scores.shape
    reserved = int(per_head * alpha)
    if alpha > 0:
        reserved = max(1, reserved)
    scores = scores.float().clone()
    if reserved:
        top = scores.topk(min(reserved, length), dim=-1).indices
        scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    chosen = scores.reshape(batch, heads * length).topk(heads * per_head, dim=-1).indices
    keep = torch.zeros(batch, heads * length, dtype=torch.bool, device=scores.device)
    return keep.scatter_(-1, chosen, True).view(batch, heads, length)


@register
class AdaKV(KVPressScorer):
    name = "adakv"
    summary = ("AdaKV: one budget per layer spread across its KV heads by score (heads keep different numbers of "
               "entries; each keeps at least alpha of the uniform share), ranked by a kvpress scorer.")
    params = (
        press_param("kvpress scorer ranking the entries"),
        Param("ratio", float, 0.5, "share of the layer's prompt entries removed (over all its heads)", min=0,
              max=0.99),
        Param("alpha", float, 0.2, "safeguard: share of the uniform per-head budget every head keeps", min=0, max=1),
    )

    def prefill_select(self, view: LayerView, stats) -> torch.Tensor | RaggedKeep | None:
        length = view.positions.shape[-1]
        per_head = self.layer_kept(length, view.layer_idx, view.layers)
        if per_head >= length:
            return None
        keep = adaptive_keep(self.prefill_scores(view, stats), per_head, self.alpha)
        return RaggedKeep.from_mask(keep)
