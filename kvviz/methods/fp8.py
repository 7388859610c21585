"""fp8 KV cache: keys and values stored in torch's float8 dtypes, as vLLM's and SGLang's ``kv_cache_dtype=fp8``.

Each element is one byte (``float8_e4m3fn``: 3 mantissa bits, range +-448; ``float8_e5m2``: 2 mantissa bits, range
+-57344). A scale maps the cache's range onto the format's: ``x ~ fp8(x / scale) * scale`` with
``scale = amax / finfo.max``, the dynamic rule serving engines use when a checkpoint ships no calibrated scales
(vLLM's ``calculate_kv_scales``). ``scale=tensor`` keeps one fp32 scale for all of a layer's keys (one for values),
``scale=head`` one per KV head; both are set by the first entries stored (the prompt) and then fixed, so later
tokens beyond that range saturate at the format's maximum, as in an engine whose scales were fixed at the first
forward. ``scale=token`` gives every token of every head its own scale (finer, more metadata).

Eviction is a gather on the token axis: codes and per-token scales follow the kept entries; tensor and head scales
stay. Attention reads a dequantized copy (a simulated kernel; real engines dequantize inside fused attention
kernels, which is what makes fp8 fast there); ``nbytes`` counts the one-byte codes and the fp32 scales.
"""

from __future__ import annotations

import torch

from kvviz.cache.protocol import QuantizationMethod, per_element
from kvviz.cache.quantized import Encoded, TokenQuantStorage, refuse_rerotation
from kvviz.cache.spec import MethodStack, Param, register

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # fp32 scales, as vLLM and SGLang keep them


def fp8_scale(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """amax / finfo.max over what shares a scale: the whole [B, H, T, D] tensor, each head, or each head's token."""
    dims = {"tensor": (1, 2, 3), "head": (2, 3), "token": (3,)}[granularity]
    return x.float().abs().amax(dim=dims, keepdim=True).clamp_min(1e-12)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale, saturate at the format's largest finite value (as engines do) and cast."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


class Fp8Storage(TokenQuantStorage):
    """One-byte K/V codes [B, H, T, D] with fp32 scales: shared by the tensor or each head (fixed by the first
    entries stored, the prompt), or one per token."""

    def __init__(self, dtype: torch.dtype, granularity: str):
        super().__init__()
        self.fp8, self.granularity = dtype, granularity

    @property
    def scales(self) -> list[torch.Tensor | None]:
        """Keys' and values' scales: [B,1,1,1], [B,H,1,1] or [B,H,T,1]."""
        return self.token_metadata if self.granularity == "token" else self.shared_metadata

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Encoded, Encoded]:
        encoded = []
        for slot, x in enumerate((keys, values)):
            if self.granularity == "token":
                scale = fp8_scale(x, "token") / torch.finfo(self.fp8).max
            else:
                if self.shared_metadata[slot] is None:  # dynamic scale from the first entries (the prompt), then fixed
                    self.shared_metadata[slot] = fp8_scale(x, self.granularity) / torch.finfo(self.fp8).max
                scale = self.shared_metadata[slot]
            codes = to_fp8(x, scale, self.fp8)
            encoded.append(Encoded(codes, (codes.float() * scale).to(x.dtype),
                                   scale if self.granularity == "token" else None))
        return encoded[0], encoded[1]


@register
class Fp8(QuantizationMethod):
    name = "fp8"
    summary = ("fp8 KV cache as vLLM / SGLang serve it: one byte per element in torch float8 (e4m3 or e5m2) with "
               "dynamic amax scales per tensor, per head or per token.")
    params = (
        Param("format", str, "e4m3", "float8 format: e4m3 (more precision, range 448) or e5m2 (more range)",
              choices=tuple(FORMATS)),
        Param("scale", str, "tensor", "what shares one fp32 scale: the layer's tensor (vLLM's default), each KV "
              "head, or each token of each head", choices=("tensor", "head", "token")),
    )

    def new_storage(self, layer_idx: int) -> Fp8Storage:
        return Fp8Storage(FORMATS[self.format], self.scale)

    def bits_per_element(self, head_dim: int, value_dim: int | None = None) -> float:
        scale_bits = 8 * SCALE_BYTES if self.scale == "token" else 0  # per key and per value of a head's token
        return per_element(8 * head_dim + scale_bits, 8 * (value_dim or head_dim) + scale_bits, head_dim, value_dim)

    def check_stack(self, stack: MethodStack) -> None:
        refuse_rerotation(self, stack)
