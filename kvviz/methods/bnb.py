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

from kvviz.cache.protocol import QuantizationMethod, per_element
from kvviz.cache.spec import MethodStack, Param, SpecError, register
from kvviz.cache.storage import KVStorage, StorageBytes, gather_tokens, tensor_bytes
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
    """Keys and values each as codes, absmax and the dequantized copy; quantized in one call when their widths match
    (MLA models cache keys wider than values, and each is padded to its own blocks)."""

    per_entry_bytes = True

    def __init__(self, kind: str):
        self.kind = kind
        self.codes: list[torch.Tensor] = []  # keys, values: [B, H, T, bytes per row]
        self.absmax: list[torch.Tensor] = []  # [B, H, T, blocks per row] fp32
        self.dequant: list[torch.Tensor] = []  # [B, H, T, D]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape[-1] == values.shape[-1]:  # one quantize call for both
            both = [t.unflatten(0, (2, keys.shape[0])) for t in _quantize(self.kind, torch.cat([keys, values]))]
            new = [[t[slot] for t in both] for slot in (0, 1)]
        else:
            new = [list(_quantize(self.kind, x)) for x in (keys, values)]
        if not self.codes:
            self.codes, self.absmax, self.dequant = (list(parts) for parts in zip(*new, strict=True))
            return
        for slot, (codes, absmax, dequant) in enumerate(new):
            self.codes[slot] = torch.cat([self.codes[slot], codes], 2)
            self.absmax[slot] = torch.cat([self.absmax[slot], absmax], 2)
            self.dequant[slot] = torch.cat([self.dequant[slot], dequant], 2)

    def keep(self, index: torch.Tensor) -> None:
        for tensors in (self.codes, self.absmax, self.dequant):
            tensors[:] = [gather_tokens(t, index) for t in tensors]

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequant[0], self.dequant[1]

    def __len__(self) -> int:
        return self.codes[0].shape[2] if self.codes else 0

    def nbytes(self) -> StorageBytes:
        return StorageBytes(codes=tensor_bytes(*self.codes), metadata=tensor_bytes(*self.absmax))


@register
class Bnb(QuantizationMethod):
    name = "bnb"
    summary = "bitsandbytes blockwise quantization of K/V: NF4, FP4 or int8, one absmax per token and head."
    params = (Param("type", str, "nf4", "bitsandbytes data type", choices=("nf4", "fp4", "int8")),)

    def new_storage(self, layer_idx: int) -> BnbStorage:
        _functional()
        return BnbStorage(self.type)

    def bits_per_element(self, head_dim: int, value_dim: int | None = None) -> float:
        code_bits = 8 if self.type == "int8" else 4

        def row_bits(dim: int) -> int:  # padded codes and one fp32 absmax per block
            padded = -(-dim // BLOCK) * BLOCK
            return padded * code_bits + 32 * padded // BLOCK

        return per_element(row_bits(head_dim), row_bits(value_dim or head_dim), head_dim, value_dim)

    def check_stack(self, stack: MethodStack) -> None:
        refuse_rerotation(self, stack)
