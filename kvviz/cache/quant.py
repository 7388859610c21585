"""Quantization primitives: bit packing and group-wise asymmetric (min/max) quantization of K/V tensors.

Tensors are ``[B, H, T, D]``: tokens on dim 2, channels on dim 3. Codes are always packed along the channel axis, so
one token's codes are one row of bytes and evicting tokens is a plain gather on the token axis, whatever the grouping.

Asymmetric quantization of a group with minimum ``lo`` and maximum ``hi`` at ``b`` bits:
``scale = (hi - lo) / (2**b - 1)``, ``zero = lo``, ``code = round((x - zero) / scale)``, ``x' = code * scale + zero``.
Scale and zero are stored in fp16 and the codes are computed from the rounded fp16 values, so ``|x - x'| <= scale/2``
up to fp16 rounding of the scale and zero (see :func:`error_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
GROUP_METADATA_BITS = 32  # what each group stores besides its codes: one fp16 scale and one fp16 zero point
_TINY_SCALE = 2.0**-14  # smallest normal fp16: keeps constant groups from dividing by zero


def bits_with_metadata(bits: float, group: float) -> float:
    """Bits per element once each ``group`` elements' scale and zero point are shared out among them."""
    return bits + GROUP_METADATA_BITS / group


def packed_width(count: int, bits: int) -> int:
    """Bytes one row of ``count`` codes takes when packed at ``bits`` bits."""
    return (count * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last axis into uint8 (``8 // bits`` codes per byte)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes; use 1, 2, 4 or 8")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    per_byte = 8 // bits
    count = codes.shape[-1]
    pad = (-count) % per_byte
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)
    packed = grouped[..., 0].clone()
    for slot in range(1, per_byte):  # or-ing shifted slices: 2-5x faster on a CPU than shifting all and summing
        packed |= grouped[..., slot] << (slot * bits)
    return packed


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``count`` uint8 codes per row."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


@dataclass
class Quantized:
    """Packed codes plus the fp16 scale and zero point that decode them (shapes depend on the grouping)."""

    codes: torch.Tensor  # uint8 [B, H, T, packed_width(D, bits)]
    scale: torch.Tensor  # fp16
    zero: torch.Tensor  # fp16


def minmax_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero for groups spanning ``[lo, hi]``."""
    scale = ((hi.float() - lo.float()) / (2**bits - 1)).to(SCALE_DTYPE).clamp_min(_TINY_SCALE)
    return scale, lo.to(SCALE_DTYPE)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of ``x`` for broadcastable ``scale`` and ``zero`` (unpacked, uint8)."""
    codes = torch.round((x.float() - zero.float()) / scale.float())
    return codes.clamp_(0, 2**bits - 1).to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float() + zero.float()).to(dtype)


def quantize_per_channel(x: torch.Tensor, bits: int, group: int,
                         dtype: torch.dtype | None = None) -> tuple[Quantized, torch.Tensor | None]:
    """KIVI's key layout: each channel quantized over groups of ``group`` consecutive tokens, and (with ``dtype``) the
    values a reader gets back, decoded from the codes before they are packed (no unpacking, no gathering of scales).

    ``x`` [B, H, T, D] with T a multiple of ``group``; scale and zero are [B, H, T // group, D].
    """
    batch, heads, length, dim = x.shape
    if length % group:
        raise ValueError(f"per-channel quantization needs whole groups: {length} tokens, group {group}")
    grouped = x.reshape(batch, heads, length // group, group, dim)
    scale, zero = minmax_params(grouped.amin(dim=3), grouped.amax(dim=3), bits)
    codes = encode(grouped, scale.unsqueeze(3), zero.unsqueeze(3), bits)
    restored = None if dtype is None else decode(codes, scale.unsqueeze(3), zero.unsqueeze(3), dtype).reshape(x.shape)
    return Quantized(pack(codes.reshape(x.shape), bits), scale, zero), restored


def channel_groups(dim: int, group: int) -> torch.Tensor:
    """Group number of each channel when channels are grouped by ``group`` (the last group may be shorter)."""
    return torch.arange(dim) // min(group, dim)


def quantize_per_token(x: torch.Tensor, bits: int, group: int,
                       dtype: torch.dtype | None = None) -> tuple[Quantized, torch.Tensor | None]:
    """KIVI's value layout: each token quantized on its own, in groups of ``group`` channels, and (with ``dtype``)
    the values a reader gets back, decoded from the codes before they are packed.

    scale and zero are [B, H, T, ceil(D / group)]; a head_dim that is not a multiple of ``group`` gets a shorter last
    group.
    """
    dim = x.shape[-1]
    groups = channel_groups(dim, group).to(x.device)
    count = int(groups[-1]) + 1
    width = min(group, dim)
    if dim % width == 0:  # whole groups: a reshape (scatter_reduce and index gathers cost several times more on a CPU)
        grouped = x.float().unflatten(-1, (count, width))
        scale, zero = minmax_params(grouped.amin(dim=-1), grouped.amax(dim=-1), bits)
        codes = encode(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
        restored = (None if dtype is None else
                    decode(codes, scale.unsqueeze(-1), zero.unsqueeze(-1), dtype).flatten(-2))
        return Quantized(pack(codes.flatten(-2), bits), scale, zero), restored
    index = groups.expand(*x.shape)
    empty = torch.zeros(*x.shape[:-1], count, dtype=torch.float32, device=x.device)
    lo = empty.scatter_reduce(-1, index, x.float(), "amin", include_self=False)
    hi = empty.scatter_reduce(-1, index, x.float(), "amax", include_self=False)
    scale, zero = minmax_params(lo, hi, bits)
    codes = encode(x, scale[..., groups], zero[..., groups], bits)
    restored = None if dtype is None else decode(codes, scale[..., groups], zero[..., groups], dtype)
    return Quantized(pack(codes, bits), scale, zero), restored


def error_bound(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Largest reconstruction error for a group: half a step, plus fp16 rounding of the stored scale and zero.

    The codes are computed against the stored (rounded) values, so rounding only matters where the top code clamps:
    the range can exceed ``(2**b - 1) * scale`` by one fp16 ulp of the scale per step, and the minimum can sit one
    ulp of the zero below it.
    """
    ulp = 2.0**-10
    return scale.float() * (0.5 + (2**bits - 1) * ulp) + zero.float().abs() * ulp
