"""TOVA (Oren et al. 2024): at every step drop the token the current query attends to least, averaged over heads."""

from __future__ import annotations

import torch

from kvviz.methods.base import Budget, EvictionMethod, LayerView, Param, register, topk_keep


@register
class TOVA(EvictionMethod):
    name = "tova"
    summary = ("Token omission via attention: whenever the cache is over budget, drop the tokens with the lowest "
               "attention from the newest query, averaged over all heads of the layer.")
    params = (Param("budget", Budget, 512, "tokens kept per layer: a count (512)"
                                           " or, with a decimal point, a ratio of the prompt (0.25; 1.0 = all)"),)
    scores_attention = True
    prefill_windows = (1,)

    def prefill_select(self, view: LayerView, stats) -> torch.Tensor | None:
        last_query = stats.window_attention[1][view.layer_idx]  # [H_q, N]: the prompt's last query
        return self._keep(view, last_query.mean(0).view(1, -1).to(view.positions.device))

    def select(self, view: LayerView) -> torch.Tensor | None:
        return self._keep(view, view.attention.float()[:, :, -1].mean(1))

    def _keep(self, view: LayerView, scores: torch.Tensor) -> torch.Tensor | None:
        """``scores`` [B, T]: one ranking per layer, shared by every KV head."""
        batch, kv_heads, length = view.positions.shape
        return topk_keep(scores.unsqueeze(1).expand(batch, kv_heads, length), self.budget.tokens(view.prompt_length))

    def budget_for(self, prompt_length: int) -> int:
        return self.budget.tokens(prompt_length)
