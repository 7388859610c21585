"""The architecture axis: storages that hold fewer heads or a low-rank latent, and the three factors of a stack.

KV bytes = full bytes * architecture factor * eviction factor * quantization factor:

- architecture: stored elements per token over the model's ``2 * kv_heads * head_dim`` (``G / kv_heads`` for merged
  heads, ``(rank + v_rank) / (2 * kv_heads * head_dim)`` for a low-rank latent);
- eviction: tokens kept over the tokens the full cache holds (every token on a global layer, the window on a local
  one: what a local layer drops by itself is not the method's doing);
- quantization: stored bits per element (codes and metadata, plus any full-precision residual) over the dtype's bits.

:func:`axis_factors` reads the three off a finished cache, so the product equals the measured bytes up to what a
factorisation cannot split (e.g. a quantizer's residual sharing a group with evicted tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.cache.storage import KeptRanges, KVStorage, StorageBytes


class ArchitectureStorage(KVStorage):
    """Wraps the layer's real storage (``inner``): appends go in compressed, attention reads the model's shape.

    Subclasses define :meth:`compress` (model K/V -> stored form) and :meth:`expand` (stored form -> model K/V).
    ``nbytes`` counts ``inner`` only: the expanded copy attention reads stands for a kernel that would read the
    stored form directly, as KIVI's dequantized copy does.
    """

    def __init__(self, inner: KVStorage):
        self.inner = inner

    # -- subclasses -------------------------------------------------------------------------------------------
    def compress(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def expand(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def calibrate(self, keys: torch.Tensor, values: torch.Tensor, rotary: torch.Tensor) -> None:
        """Fit what the storage needs from the prompt's K/V (``rotary`` [T]: their rotary positions)."""

    def weight_bytes(self) -> int:
        """Bytes of fitted projections: weights, not cache (reported separately)."""
        return 0

    def on_keep(self, index: torch.Tensor | None, kept: KeptRanges | None) -> None:
        """Mirror an eviction in the subclass's own per-entry bookkeeping."""

    # -- KVStorage --------------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.append(*self.compress(keys, values))

    def keep(self, index: torch.Tensor) -> None:
        self.inner.keep(index)
        self.on_keep(index, None)

    def keep_ranges(self, kept: KeptRanges) -> None:
        self.inner.keep_ranges(kept)
        self.on_keep(None, kept)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expand(*self.inner.materialize())

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored form as the inner storage gives it back (dequantized when quantized)."""
        return self.inner.materialize()

    def __len__(self) -> int:
        return len(self.inner)

    def nbytes(self) -> StorageBytes:
        return self.inner.nbytes()


@dataclass
class AxisFactors:
    """A stack's bytes as full bytes times one factor per axis (each 1.0 when the axis is not used)."""

    full_bytes: int
    architecture: float
    eviction: float
    quantization: float
    measured_bytes: int

    @property
    def predicted_bytes(self) -> float:
        return self.full_bytes * self.architecture * self.eviction * self.quantization

    def to_json(self) -> dict:
        return {"full_bytes": self.full_bytes, "architecture": self.architecture, "eviction": self.eviction,
                "quantization": self.quantization, "predicted_bytes": round(self.predicted_bytes),
                "measured_bytes": self.measured_bytes}


def axis_factors(cache, kv_heads: int, head_dim: int, tokens_seen: int, bytes_per_element: int,
                 full_bytes: int | None = None, value_dim: int | None = None) -> AxisFactors:
    """The three factors of a finished cache, each from its own axis, next to the bytes it measures.

    Architecture from the method's formula, eviction from the entries still cached, quantization from the quantizer's
    bits per element at the stored vector size over the dtype's bits. ``tokens_seen``: tokens that entered the cache.
    The product misses the measured bytes only by what the quantizer holds beyond its formula (a full-precision
    residual) or below it. ``full_bytes``: what the model's full cache holds (default: the K/V formula);
    ``value_dim``: a cached value's width where it differs from a key's ``head_dim`` (MLA models).
    """
    stack = cache.stack
    held = cache.layer_types.held_total(tokens_seen)  # tokens the full cache holds, summed over layers (per type)
    full = full_bytes or 2 * kv_heads * head_dim * held * bytes_per_element
    value_dim = value_dim or head_dim
    architecture, stored_key, stored_value = 1.0, head_dim, value_dim
    if stack.architecture is not None:
        architecture = stack.architecture.cache_fraction(kv_heads, head_dim)
        stored_key = stack.architecture.stored_dim(kv_heads, head_dim)
        stored_value = stack.architecture.stored_dim(kv_heads, value_dim)
    heads = cache.layers[0].positions.shape[1]
    kept = sum(layer.positions[0].numel() for layer in cache.layers)  # entries over every layer and stored head
    eviction = kept / (heads * held)  # of what the full cache holds: a local layer's window is not eviction
    quantization = 1.0
    if stack.quantization is not None:
        try:
            quantization = stack.quantization.bits_per_element(stored_key, stored_value) / (8 * bytes_per_element)
        except NotImplementedError:  # a backend without a formula: its measured share
            quantization = cache.nbytes().total / (full * architecture * eviction)
    return AxisFactors(full, architecture, eviction, quantization, cache.nbytes().total)
