"""A control: keep a random subset of tokens per head (seeded, so runs repeat)."""

from __future__ import annotations

import torch

from kvviz.cache.protocol import LayerView, ScoringEviction
from kvviz.cache.spec import Budget, Param, register


@register
class RandomKeep(ScoringEviction):
    name = "random"
    summary = "Control: keep a random subset per KV head within the budget; the newest token always stays."
    params = (
        Param("budget", Budget, 512, "tokens kept per head"),
        Param("seed", int, 0, "random seed (each layer draws its own stream)", min=0, max=2**31 - 1),
    )

    def new_state(self, layer_idx: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 100_003 + layer_idx)

    def decode_scores(self, view: LayerView) -> torch.Tensor:
        return torch.rand(view.positions.shape, generator=view.state)

    def always_kept(self, view: LayerView) -> torch.Tensor | None:
        """The newest token, once decoding has begun."""
        length = view.positions.shape[-1]
        return torch.arange(length) == length - 1 if view.step > 0 else None

    def budget_for(self, prompt_length: int) -> int:
        return self.budget.tokens(prompt_length)
