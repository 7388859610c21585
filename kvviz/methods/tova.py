"""TOVA (Oren et al. 2024): at every step drop the token the current query attends to least, averaged over heads."""

from __future__ import annotations

import torch

from kvviz.cache.protocol import Decode, LayerView, Schedule, ScoringEviction
from kvviz.cache.spec import Budget, Param, register


@register
class TOVA(ScoringEviction):
    name = "tova"
    summary = ("Token omission via attention: whenever the cache is over budget, drop the tokens with the lowest "
               "attention from the newest query, averaged over all heads of the layer.")
    params = (Param("budget", Budget, 512, "tokens kept per layer"),)
    schedule = Schedule(Decode.AFTER_ATTENTION, windows=(1,))

    def prefill_scores(self, view: LayerView, stats) -> torch.Tensor:
        """The prompt's last query's attention, averaged over every head of the layer: one ranking, [1, 1, T]."""
        return stats.window_attention[1][view.layer_idx].mean(0).view(1, 1, -1)

    def decode_scores(self, view: LayerView) -> torch.Tensor:
        """The newest query's attention, averaged over every head of the layer: [B, 1, T]."""
        return view.attention.float()[:, :, -1].mean(1).unsqueeze(1)

    def budget_for(self, prompt_length: int) -> int:
        return self.budget.tokens(prompt_length)
