"""Merged KV heads (MHA -> GQA -> MQA): mean-pool the model's KV heads into G groups, with no uptraining.

This is the conversion the GQA paper (Ainslie et al. 2023) starts from before uptraining: the keys and values of each
group of ``kv_heads / G`` consecutive heads are averaged, and every query head of the group attends to the merged head.
The cache holds G heads per layer (real bytes: ``G / kv_heads`` of full). Attention is handed the merged heads
expanded back to the model's KV head count (a copy per group member); that expansion stands for a kernel reading the
merged head for each query head and is not counted as held bytes.

Stacking: eviction chooses per merged head (the query heads of a group vote together, as GQA groups do), and a
quantizer stores the merged heads. At ``G = kv_heads`` nothing is pooled and the output equals full token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvviz.cache.architecture import ArchitectureStorage
from kvviz.cache.protocol import ArchitectureMethod
from kvviz.cache.spec import Param, Sizing, SpecError, register
from kvviz.cache.storage import KVStorage


class MergedHeadsStorage(ArchitectureStorage):
    """Holds ``groups`` mean-pooled heads in ``inner``; attention reads each repeated over its group."""

    def __init__(self, inner: KVStorage, groups: int):
        super().__init__(inner)
        self.groups = groups
        self.model_heads = groups

    def cache_heads(self, model_heads: int) -> int:
        return self.groups

    def compress(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.model_heads = heads = keys.shape[1]
        if heads == self.groups:
            return keys, values

        def pool(x: torch.Tensor) -> torch.Tensor:  # keys and values may differ in size (MLA models)
            return x.unflatten(1, (self.groups, heads // self.groups)).mean(2)

        return pool(keys), pool(values)

    def expand(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        repeat = self.model_heads // self.groups
        if repeat == 1:
            return keys, values
        return keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)

    def write_keys(self, index: torch.Tensor, keys: torch.Tensor) -> None:
        """Re-rotated keys (StreamingLLM's position shift) arrive expanded: write one per group."""
        self.inner.write_keys(index, keys[:, :: self.model_heads // self.groups])


@register
class MergeHeads(ArchitectureMethod):
    name = "merge_heads"
    summary = ("Mean-pool the model's KV heads into kv_heads groups (GQA's conversion, no uptraining; 1 = MQA): "
               "the cache holds that many heads per layer.")
    params = (Param("kv_heads", int, 1, "KV heads kept per layer; must divide the model's KV head count (1 = MQA)",
                    min=1, max=1024),)
    sized_by = "kv_heads"

    @classmethod
    def sweep_points(cls, shares: Sequence[float], sizing: Sizing,
                     fixed: dict[str, Any]) -> list[tuple[float, MergeHeads]]:
        """Every head count that divides the model's and is below it (its few values are its budgets)."""
        heads = sizing.kv_heads
        return [(groups / heads, cls(**(fixed | {"kv_heads": groups})))
                for groups in range(1, heads) if heads % groups == 0]

    def check_model(self, kv_heads: int, head_dim: int) -> None:
        if kv_heads % self.kv_heads:
            divisors = [g for g in range(1, kv_heads + 1) if kv_heads % g == 0]
            raise SpecError(f"merge_heads:kv_heads={self.kv_heads} does not divide this model's {kv_heads} KV heads; "
                            f"choose {'|'.join(map(str, divisors))}")

    def cache_heads(self, kv_heads: int) -> int:
        return self.kv_heads

    def cache_fraction(self, kv_heads: int, head_dim: int) -> float:
        return self.kv_heads / kv_heads

    def wrap_storage(self, layer_idx: int, inner: KVStorage, cache) -> MergedHeadsStorage:
        return MergedHeadsStorage(inner, self.kv_heads)
