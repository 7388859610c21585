"""H2O (Zhang et al. 2023): heavy hitters by attention accumulated per head at every step, plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.cache.protocol import Decode, EvictionMethod, LayerView, Schedule, per_kv_head, topk_keep
from kvviz.cache.spec import Budget, Param, register


@dataclass
class H2OState:
    """Accumulated attention of the entries H2O kept at its last selection, [B, H_kv, T], with their absolute
    positions: the next step matches scores to entries by position, so the cache may keep more than H2O chose
    (protected spans, :mod:`kvviz.cache.protect`; those start again from 0)."""

    scores: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def carried(self, positions: torch.Tensor) -> torch.Tensor:
        """The accumulated score of each entry at ``positions`` [B, H_kv, T] (ascending per head); 0 for new ones."""
        if self.scores is None:
            return torch.zeros(positions.shape, device=positions.device)
        known = self.positions.shape[-1]
        if positions.shape[-1] >= known and torch.equal(positions[..., :known], self.positions):
            # decoding: the entries kept last time, then the new ones (no index to search)
            return torch.cat([self.scores, self.scores.new_zeros(*positions.shape[:2], positions.shape[-1] - known)],
                             dim=-1)
        index = torch.searchsorted(self.positions, positions.contiguous()).clamp(max=self.positions.shape[-1] - 1)
        matched = self.positions.gather(-1, index) == positions
        return torch.where(matched, self.scores.gather(-1, index), torch.zeros((), device=self.scores.device))


@register
class H2O(EvictionMethod):
    name = "h2o"
    summary = ("Heavy hitters: keep the tokens with the most attention accumulated per KV head over all queries so "
               "far, plus the most recent ones (0.1 + 0.1 is the paper's 20% setting).")
    params = (
        Param("heavy", Budget, 0.1, "heavy-hitter tokens", ratio_of="the current length"),
        Param("recent", Budget, 0.1, "recent tokens always kept", ratio_of="the current length"),
    )
    schedule = Schedule(Decode.AFTER_ATTENTION, prefill_attention=True)

    def new_state(self, layer_idx: int) -> H2OState:
        return H2OState()

    def prefill_select(self, view: LayerView, stats) -> torch.Tensor | None:
        batch, kv_heads, length = view.positions.shape
        received = None if stats is None else stats.key_attention.get(view.layer_idx)
        if received is None:
            scores = torch.zeros(batch, kv_heads, length)
        else:
            scores = per_kv_head(received[:, :length].unsqueeze(0), kv_heads).expand(batch, -1, -1)
        return self._evict(view, scores.to(view.positions.device))

    def select(self, view: LayerView) -> torch.Tensor | None:
        kv_heads = view.positions.shape[1]
        received = per_kv_head(view.attention.float().sum(2), kv_heads)
        return self._evict(view, view.state.carried(view.positions).to(received.device) + received)

    def _evict(self, view: LayerView, scores: torch.Tensor) -> torch.Tensor | None:
        """Keep the recent window and the top heavy hitters outside it; carry the kept entries' scores forward."""
        length = scores.shape[-1]
        seen = int(view.positions.max()) + 1
        recent = min(length, self.recent.tokens(seen))
        forced = torch.zeros(length, dtype=torch.bool, device=scores.device)
        forced[length - recent:] = True
        keep = topk_keep(scores, recent + self.heavy.tokens(seen), forced)
        if keep is None:
            view.state.scores, view.state.positions = scores, view.positions.contiguous()
        else:
            view.state.scores, view.state.positions = scores.gather(-1, keep), view.positions.gather(-1, keep)
        return keep

    def budget_for(self, prompt_length: int) -> int:
        return self.heavy.tokens(prompt_length) + self.recent.tokens(prompt_length)
