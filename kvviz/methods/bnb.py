"""bitsandbytes blockwise quantization of K/V (NF4, FP4 or int8), as used for weights, applied to the cache.

Every token of every head is one block of ``head_dim`` elements (padded with zeros to a multiple of bitsandbytes'
smallest CPU block, 64) with its own absmax, so evicting a token drops one row of codes and one absmax: a gather on
the token axis. Tokens are quantized as they arrive (no full-precision residual). The 16- or 256-entry code tables
are constants shared by every cache and are not counted.

Attention reads dequantized values (a simulated kernel); the storage keeps a dequantized copy, updated only for new
tokens, and ``nbytes`` counts the packed codes and the fp32 absmax bitsandbytes stores.
"""

from __future__ import annotations

import torch

from kvviz.core.storage import KVStorage, StorageBytes, gather_tokens, tensor_bytes
from kvviz.methods.base import MethodStack, Param, QuantizationMethod, SpecError, register
from kvviz.methods.kivi import refuse_rerotation

BLOCK = 64  # smallest blocksize bitsandbytes' CPU kernels accept above 32 for every type


def _functional():
    try:
        import bitsandbytes.functional as functional
    except ImportError as error:  # pragma: no cover - bitsandbytes is in requirements.txt
        raise SpecError(f"bnb needs the bitsandbytes package ({error}); pip install bitsandbytes") from None
    return functional


def _quantize(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [B, H, T, bytes per row], absmax [B, H, T, blocks per row] and the dequantized [B, H, T, D] of ``x``."""
    functional = _functional()
    batch, heads, length, dim = x.shape
    padded = -(-dim // BLOCK) * BLOCK
    rows = torch.nn.functional.pad(x.float(), (0, padded - dim)).reshape(-1, padded)
    if kind == "int8":
        codes, state = functional.quantize_blockwise(rows, blocksize=BLOCK)
        restored = functional.dequantize_blockwise(codes, state)
    else:
        codes, state = functional.quantize_4bit(rows, blocksize=BLOCK, quant_type=kind)
        restored = functional.dequantize_4bit(codes, state)
    shape = (batch, heads, length)
    return (codes.reshape(*shape, -1), state.absmax.reshape(*shape, -1),
            restored.reshape(*shape, padded)[..., :dim].to(x.dtype))


class BnbStorage(KVStorage):
    """Keys and values stacked on a leading axis of 2, so each step costs one quantize and one dequantize call."""

    per_entry_bytes = True

    def __init__(self, kind: str):
        self.kind = kind
        self.codes: torch.Tensor | None = None  # [2, B, H, T, bytes per row]
        self.absmax: torch.Tensor | None = None  # [2, B, H, T, blocks per row] fp32
        self.dequant: torch.Tensor | None = None  # [2, B, H, T, D]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch = keys.shape[0]
        codes, absmax, dequant = (t.unflatten(0, (2, batch)) for t in _quantize(self.kind, torch.cat([keys, values])))
        if self.codes is None:
            self.codes, self.absmax, self.dequant = codes, absmax, dequant
        else:
            self.codes = torch.cat([self.codes, codes], 3)
            self.absmax = torch.cat([self.absmax, absmax], 3)
            self.dequant = torch.cat([self.dequant, dequant], 3)

    def keep(self, index: torch.Tensor) -> None:
        both = torch.cat([index, index])
        self.codes, self.absmax, self.dequant = (gather_tokens(t.flatten(0, 1), both).unflatten(0, (2, -1))
                                                 for t in (self.codes, self.absmax, self.dequant))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequant[0], self.dequant[1]

    def __len__(self) -> int:
        return 0 if self.codes is None else self.codes.shape[3]

    def nbytes(self) -> StorageBytes:
        return StorageBytes(codes=tensor_bytes(self.codes), metadata=tensor_bytes(self.absmax))


@register
class Bnb(QuantizationMethod):
    name = "bnb"
    summary = "bitsandbytes blockwise quantization of K/V: NF4, FP4 or int8, one absmax per token and head."
    params = (Param("type", str, "nf4", "bitsandbytes data type", choices=("nf4", "fp4", "int8")),)

    def new_storage(self, layer_idx: int) -> BnbStorage:
        _functional()
        return BnbStorage(self.type)

    def bits_per_element(self, head_dim: int) -> float:
        padded = -(-head_dim // BLOCK) * BLOCK
        code_bits = 8 if self.type == "int8" else 4
        return (padded * code_bits + 32 * padded // BLOCK) / head_dim

    def check_stack(self, stack: MethodStack) -> None:
        refuse_rerotation(self, stack)
