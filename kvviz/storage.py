"""How a layer's K/V entries are held in memory. Dense tensors here; quantized stores live with their methods.

A storage holds entries in cache order, per KV head: keys and values ``[B, H_kv, T, D]``. Eviction keeps a subset
(``keep``), decoding appends, attention reads ``materialize()``. ``nbytes`` counts exactly the tensors held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StorageBytes:
    """Bytes a storage holds, split the way the memory bars show it."""

    codes: int = 0  # packed quantized codes
    metadata: int = 0  # scales, zero points and other quantization bookkeeping
    full_precision: int = 0  # entries kept in the model's dtype (a dense cache, or a quantizer's residual)

    @property
    def total(self) -> int:
        return self.codes + self.metadata + self.full_precision

    def __add__(self, other: StorageBytes) -> StorageBytes:
        return StorageBytes(
            self.codes + other.codes, self.metadata + other.metadata, self.full_precision + other.full_precision
        )


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gather_tokens(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Select entries along the token axis (dim 2) per head: ``tensor`` [B, H, T, ...], ``index`` [B, H, n].

    Done as one row copy over a flattened [B*H*T, rest] view: several times faster than ``gather`` with an index
    expanded over the head dimension, which is what keeps eviction cheap on every decode step.
    """
    batch, heads, length = tensor.shape[:3]
    rest = tensor.shape[3:]
    offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * length
    rows = (index.to(offsets.device) + offsets).reshape(-1)
    picked = tensor.reshape(batch * heads * length, -1).index_select(0, rows.to(tensor.device))
    return picked.view(batch, heads, index.shape[-1], *rest)


class KVStorage:
    """Protocol every storage follows."""

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def keep(self, index: torch.Tensor) -> None:
        """Keep only entries ``index`` [B, H, n] (ascending), dropping the rest."""
        raise NotImplementedError

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as attention reads them (dequantized where stored in fewer bits)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def nbytes(self) -> StorageBytes:
        raise NotImplementedError


class DenseStorage(KVStorage):
    """Entries kept as they come, in the model's dtype: the ``full`` cache."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)

    def keep(self, index: torch.Tensor) -> None:
        self.keys = gather_tokens(self.keys, index)
        self.values = gather_tokens(self.values, index)

    def replace_keys(self, keys: torch.Tensor) -> None:
        """Swap in re-rotated keys (StreamingLLM's position shift)."""
        self.keys = keys

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def nbytes(self) -> StorageBytes:
        return StorageBytes(full_precision=tensor_bytes(self.keys, self.values))
