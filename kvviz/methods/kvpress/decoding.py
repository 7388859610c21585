"""Periodic decode-time compression (kvpress's DecodingPress): every ``every`` generated steps, each layer is
compressed back to ``target`` entries per KV head by a kvpress scorer, so long generations stay bounded.

The prompt is left whole; compression starts with generation. The step count matches DecodingPress's (every fed
token counts, the first decode step is 1), and so does the cut: DecodingPress compresses after step ``every``'s
attention, kvviz as step ``every + 1``'s token arrives, scoring the older entries only, so the cache holds between
``target + 1`` and ``target + every`` entries per head once rounds begin. The ledger records each round's evictions
at the step that made them (``every + 1``, ``2 * every + 1``, ...). Tied scores break as in DecodingPress, whose
cache holds the last round's kept entries in score order (see ``_kvpress_layout``). Scorers are those whose score reads
only the cached keys and values (knorm, keydiff, lagkv, random): the others need hidden states that kvviz does not
buffer during decoding.
"""

from __future__ import annotations

import torch

from kvviz.cache.protocol import EvictionMethod, LayerView
from kvviz.cache.spec import Param, register
from kvviz.methods.kvpress.scorer import press_param, scorer_press

CACHE_ONLY_PRESSES = ("knorm", "keydiff", "lagkv", "random")


@register
class Decoding(EvictionMethod):
    name = "decoding"
    summary = ("Periodic decode-time compression (kvpress's DecodingPress): every `every` generated steps, each KV "
               "head is cut back to its `target` top entries under a kvpress scorer; the prompt is left whole.")
    params = (
        press_param("kvpress scorer (one reading only cached keys and values)", "knorm", CACHE_ONLY_PRESSES),
        Param("every", int, 16, "generated steps between compressions (DecodingPress's compression_interval)",
              min=1, max=1 << 20),
        Param("target", int, 256, "entries per KV head after each compression (DecodingPress's target_size)",
              min=1, max=1 << 24),
    )

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> Decoding:
        """Back to ``tokens`` entries every 4 generated steps."""
        return cls(target=tokens, every=4)

    def new_state(self, layer_idx: int) -> dict:
        return {"steps": 0}

    def prefill_select(self, view: LayerView, stats) -> None:
        return None  # the prompt stays whole, as with DecodingPress

    def select(self, view: LayerView) -> torch.Tensor | None:
        """DecodingPress compresses right after the ``every``-th step's attention; the same cut is made here as the
        next step's token arrives (before it attends): the older entries are scored and cut to ``target``, and the
        new token stays. Keys computed in between are then the same as under DecodingPress."""
        view.state["steps"] += 1
        if view.state["steps"] <= self.every:
            return None
        view.state["steps"] = 1  # the new token is the first step of the next interval
        older = view.positions.shape[-1] - 1
        if older <= self.target:
            return None
        keys, values = view.entries()
        with torch.inference_mode():
            press = scorer_press(view.state, self.press)
            scores = press.score(None, None, keys[:, :, :older], values[:, :, :older], None, {})
        positions = view.positions[..., :older]
        layout = self._kvpress_layout(view.state, positions)
        ranked = layout.gather(-1, scores.float().gather(-1, layout).topk(self.target, dim=-1).indices)
        view.state["ranked"] = positions.gather(-1, ranked)
        chosen = ranked.sort(dim=-1).values
        newest = torch.full((*chosen.shape[:2], 1), older, dtype=chosen.dtype, device=chosen.device)
        return torch.cat([chosen, newest], dim=-1)

    def _kvpress_layout(self, state: dict, positions: torch.Tensor) -> torch.Tensor:
        """[B, H, T] the order DecodingPress's cache holds these entries in, as indices into ``positions``.

        Scores tie (a repeated token's first-layer keys differ by RoPE only, which keeps norms), and top-k breaks
        ties by order; kvpress gathers the kept entries in score order and appends new tokens after them, while
        kvviz keeps position order. Scoring in kvpress's order makes the same choice among tied entries.
        """
        ranked = state.get("ranked")  # the previous round's kept positions, in its top-k order
        if ranked is None:  # before the first round both caches are in position order
            return torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
        rank = torch.full((*positions.shape[:2], int(positions.max()) + 1), -1, dtype=torch.long,
                          device=positions.device)
        rank.scatter_(-1, ranked, torch.arange(ranked.shape[-1], device=positions.device).expand_as(ranked))
        rank = rank.gather(-1, positions)
        return torch.where(rank >= 0, rank, ranked.shape[-1] + positions).argsort(dim=-1)
