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
from kvviz.cache.quantized import Encoded, TokenQuantStorage, refuse_rerotation
from kvviz.cache.spec import MethodStack, Param, SpecError, register

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


class BnbStorage(TokenQuantStorage):
    """Keys and values each as codes, one fp32 absmax per token's block (its per-token metadata) and the dequantized
    copy; quantized in one call when their widths match (MLA models cache keys wider than values, and each is padded
    to its own blocks)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Encoded, Encoded]:
        if keys.shape[-1] == values.shape[-1]:  # one quantize call for both
            both = [t.unflatten(0, (2, keys.shape[0])) for t in _quantize(self.kind, torch.cat([keys, values]))]
            parts = [[t[slot] for t in both] for slot in (0, 1)]
        else:
            parts = [list(_quantize(self.kind, x)) for x in (keys, values)]
        (key_codes, key_absmax, key_restored), (value_codes, value_absmax, value_restored) = parts
        return Encoded(key_codes, key_restored, key_absmax), Encoded(value_codes, value_restored, value_absmax)


@register
class Bnb(QuantizationMethod):
    name = "bnb"
    summary = "bitsandbytes blockwise quantization of K/V: NF4, FP4 or int8, one absmax per token and head."
    params = (Param("type", str, "nf4", "bitsandbytes data type", choices=("nf4", "fp4", "int8")),)
    sized_by = "type"

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
