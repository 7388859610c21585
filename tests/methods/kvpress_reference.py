"""Helpers for the agreement tests: which entries kvpress's own presses keep, recorded per layer and head."""

from __future__ import annotations

import torch


def overlaps(cache, reference: dict[int, list[torch.Tensor]]) -> list[float]:
    """Per layer and KV head: the share of kvpress's kept entries that kvviz keeps too."""
    shares = []
    for layer, heads in reference.items():
        ours = cache.kept_positions(layer)
        for head, expected in enumerate(heads):
            shares.append(len(set(ours[head].tolist()) & set(expected.tolist())) / max(1, expected.numel()))
    return shares


def run_press(loaded, ids: list[int], press) -> None:
    """One prefill of ``ids`` under ``press`` (the press records what it keeps)."""
    from transformers import DynamicCache

    with torch.inference_mode(), press(loaded.model):
        loaded.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=loaded.config))
