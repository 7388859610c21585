"""PyramidKV (Cai et al. 2024): layer-adaptive budgets, many tokens in the lowest layers and few in the highest.

The total matches a uniform budget of ``int(N * (1 - ratio))`` per layer; the per-layer counts fall linearly from
the first layer to the last, the smallest being ``1/beta`` of the average (kvpress's ``PyramidKVPress`` rule, which
always applies the ratio and falls back to the uniform count when the pyramid does not fit the prompt). Within a
layer every KV head keeps its top-scoring entries under the chosen kvpress scorer (SnapKV's window votes by default,
as in the paper).
"""

from __future__ import annotations

from kvviz.cache.spec import Param, SpecError, register
from kvviz.methods.kvpress.scorer import KVPressScorer, press_param


def pyramid_kept(length: int, layer_idx: int, layers: int, ratio: float, window: int, beta: int) -> int:
    """Entries layer ``layer_idx`` of ``layers`` keeps out of ``length`` under PyramidKV's linear allocation.

    The non-window part of the budget, ``length * (1 - ratio)`` on average, is split so that the top layer gets
    ``1/beta`` of it and the bottom layer ``2 - 1/beta`` times it (the mean stays the average); when the bottom
    layer would need more than the prompt holds, it is capped there and the top layer takes the rest.
    """
    average = length * (1 - ratio)
    lowest = average / beta
    highest = 2 * average - lowest
    if highest >= length - window:
        highest = length - window
        lowest = 2 * average - highest
    if not length >= highest >= lowest >= window:
        return max(1, round(length * (1 - ratio)))  # the pyramid does not fit: a uniform budget
    slope = (highest - lowest) / (layers - 1) if layers > 1 else 0.0
    return round(highest - layer_idx * slope)


@register
class PyramidKV(KVPressScorer):
    name = "pyramidkv"
    summary = ("PyramidKV: per-layer budgets falling linearly from the first layer to the last (same total as a "
               "uniform ratio); each layer keeps its top entries per KV head under a kvpress scorer.")
    params = (
        press_param("kvpress scorer ranking the entries within a layer"),
        Param("ratio", float, 0.5, "average share of the prompt's entries removed per layer", min=0, max=0.99),
        Param("beta", int, 20, "steepness: the top layer keeps 1/beta of the average budget", min=1, max=1000),
        Param("window", int, 64, "observation window (kvpress's window_size): SnapKV's voters, and the floor of "
              "every layer's budget", min=1, max=8192),
    )

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> PyramidKV | None:
        """As the other kvpress wrappers, with the window halved to fit below the budget when the default does not."""
        sized = super().at_budget(tokens, prompt_length)
        if sized is None or sized.window < tokens:
            return sized
        return cls(press=sized.press, ratio=sized.ratio, window=max(1, tokens // 2))

    def press_settings(self) -> dict:
        window = {"window_size": self.window} if self.press in ("snapkv", "pyramidkv") else {}
        return super().press_settings() | window

    def check_context(self, prompt_length: int) -> None:
        if self.ratio > 0 and self.press in ("snapkv", "pyramidkv") and prompt_length <= self.window:
            raise SpecError(f"pyramidkv window {self.window} is not shorter than the prompt ({prompt_length} tokens)")
        super().check_context(prompt_length)

    def layer_kept(self, length: int, layer_idx: int, layers: int) -> int:
        if self.ratio == 0:
            return length
        return min(length, pyramid_kept(length, layer_idx, layers, self.ratio, self.window, self.beta))
