"""SnapKV (Li et al. 2024): one prefill-time selection per KV head from the attention of the prompt's last queries."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvviz.cache.protocol import Decode, LayerView, Schedule, ScoringEviction, per_kv_head
from kvviz.cache.spec import Budget, Param, SpecError, register


def pooled_window_scores(window_sum: torch.Tensor, window: int, kernel: int, pool: str, kv_heads: int) -> torch.Tensor:
    """SnapKV's vote: [H_q, N] attention summed over the last ``window`` queries -> [1, H_kv, N - window] scores.

    Mean over the window's queries, pooled along the sequence (neighbours of a hit survive with it), then averaged
    over the query heads of each GQA group so every KV head keeps one set.
    """
    prefix = window_sum[:, : window_sum.shape[-1] - window].float().unsqueeze(0) / window  # [1, H_q, N - w]
    if pool == "max":
        pooled = F.max_pool1d(prefix, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(prefix, kernel_size=kernel, stride=1, padding=kernel // 2)
    return per_kv_head(pooled, kv_heads, mean=True)


@register
class SnapKV(ScoringEviction):
    name = "snapkv"
    summary = ("Compress the prompt once: each KV head keeps the tokens the last `window` prompt queries attend to "
               "(pooled along the sequence, GQA groups averaged); the window itself is always kept.")
    schedule = Schedule(Decode.NEVER)  # each instance adds its observation window (see __init__)
    params = (
        Param("budget", Budget, 1024, "tokens kept per head including the window"),
        Param("window", int, 32, "observation window: last prompt queries that vote (paper 32; kvpress 64)",
              min=1, max=8192),
        Param("kernel", int, 7, "pooling kernel along the sequence, odd (paper 7; kvpress 5)", min=1, max=255),
        Param("pool", str, "max", "pooling of the votes (paper max; kvpress avg)", choices=("max", "avg")),
    )

    def __init__(self, **values: Any):
        super().__init__(**values)
        self.schedule = Schedule(Decode.NEVER, windows=(self.window,))

    def validate(self) -> None:
        if self.kernel % 2 == 0:
            raise SpecError(f"bad value in 'snapkv:kernel={self.kernel}': the pooling kernel must be odd")
        if not self.budget.is_ratio and self.budget.value <= self.window:
            raise SpecError(f"snapkv budget {self.budget} (a token count) must exceed the observation window "
                            f"{self.window} (the window is always kept); a budget is {Budget.rule()}")

    def check_context(self, prompt_length: int) -> None:
        budget = self.budget.tokens(prompt_length)
        if budget >= prompt_length:
            return  # nothing to evict
        if self.window >= prompt_length:
            raise SpecError(f"snapkv window {self.window} is not shorter than the prompt ({prompt_length} tokens)")
        if budget <= self.window:
            raise SpecError(f"snapkv budget {self.budget} is {budget} tokens on this prompt, not more than the "
                            f"observation window {self.window}")

    def prefill_scores(self, view: LayerView, stats) -> torch.Tensor:
        """The pooled votes of the window's queries; the window itself scores infinity (always kept)."""
        window_sum = stats.window_attention[self.window][view.layer_idx]
        scores = pooled_window_scores(window_sum, self.window, self.kernel, self.pool, view.positions.shape[1])
        return F.pad(scores, (0, self.window), value=float("inf"))

    def budget_for(self, prompt_length: int) -> int:
        return min(prompt_length, self.budget.tokens(prompt_length))

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> SnapKV:
        """The budget, with the observation window halved to fit when the default would not leave room."""
        window = next(p.default for p in cls.params if p.name == "window")
        return cls(budget=tokens, window=window if window < tokens else max(1, tokens // 2))
