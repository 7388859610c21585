"""The skeleton of a storage that quantizes every token on its own as it arrives (fp8, bitsandbytes).

Such a store holds, for keys and for values: codes ``[B, H, T, ...]``, metadata that belongs to each token (a
per-token scale, a block's absmax) and follows eviction, metadata shared by all tokens (a per-tensor or per-head
scale set once) that stays, and the dequantized copy attention reads, extended only by new tokens. There is no
full-precision residual, so every entry costs the same bytes and eviction is a gather on the token axis. A
subclass writes only :meth:`TokenQuantStorage.encode`; group quantizers with a residual (KIVI) have their own store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.cache.spec import Method, MethodStack, SpecError
from kvviz.cache.storage import KVStorage, StorageBytes, gather_tokens, tensor_bytes

KEYS, VALUES = 0, 1


@dataclass
class Encoded:
    """New tokens of keys or of values as one storage holds them."""

    codes: torch.Tensor  # [B, H, T, ...]
    restored: torch.Tensor  # [B, H, T, D] dequantized, in the model's dtype
    token_metadata: torch.Tensor | None = None  # [B, H, T, ...] per-token scales or absmax; None when shared only


def _cat(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    if new is None:
        return old
    return new if old is None else torch.cat([old, new], dim=2)


def _gather_codes(codes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One-byte codes are gathered as uint8: index_select has no kernel for torch's float8 dtypes."""
    if codes.element_size() != 1:
        return gather_tokens(codes, index)
    return gather_tokens(codes.view(torch.uint8), index).view(codes.dtype)


class TokenQuantStorage(KVStorage):
    """Codes, per-token metadata, shared metadata and a dequantized copy, each a ``[keys, values]`` pair."""

    per_entry_bytes = True

    def __init__(self) -> None:
        self.codes: list[torch.Tensor | None] = [None, None]
        self.token_metadata: list[torch.Tensor | None] = [None, None]
        self.shared_metadata: list[torch.Tensor | None] = [None, None]  # set by encode, never gathered
        self.dequant: list[torch.Tensor | None] = [None, None]

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Encoded, Encoded]:
        """Quantize new keys and values ``[B, H, T, D]`` (setting ``shared_metadata`` the first time if it has any)."""
        raise NotImplementedError

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for slot, new in enumerate(self.encode(keys, values)):
            self.codes[slot] = _cat(self.codes[slot], new.codes)
            self.dequant[slot] = _cat(self.dequant[slot], new.restored)
            self.token_metadata[slot] = _cat(self.token_metadata[slot], new.token_metadata)

    def keep(self, index: torch.Tensor) -> None:
        for slot in (KEYS, VALUES):
            self.codes[slot] = _gather_codes(self.codes[slot], index)
            self.dequant[slot] = gather_tokens(self.dequant[slot], index)
            if self.token_metadata[slot] is not None:
                self.token_metadata[slot] = gather_tokens(self.token_metadata[slot], index)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequant[KEYS], self.dequant[VALUES]

    def __len__(self) -> int:
        return 0 if self.codes[KEYS] is None else self.codes[KEYS].shape[2]

    def nbytes(self) -> StorageBytes:
        return StorageBytes(codes=tensor_bytes(*self.codes),
                            metadata=tensor_bytes(*self.token_metadata, *self.shared_metadata))


def refuse_rerotation(method: Method, stack: MethodStack) -> None:
    """Re-rotating keys after every eviction would re-quantize them each time, compounding the error."""
    if stack.eviction is not None and stack.eviction.rerotate:
        raise SpecError(f"'{stack.eviction.spec()}' re-rotates cached keys, which {method.name} stores quantized; "
                        f"use rerotate=0 with {method.name}")
