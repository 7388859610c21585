"""KIVI: keys quantized per channel, values per token, the newest tokens kept in full precision.

Keys have outlier channels (a few channels are large for every token), so KIVI gives each channel its own scale over a
group of ``group`` consecutive tokens; values have no such structure and are quantized per token in groups of
``group`` channels. The newest tokens stay in the model's dtype: a full-precision residual of ``residual`` to
``residual + group - 1`` tokens. Whenever it holds ``residual + group`` tokens, its oldest ``group`` tokens become one
quantized key group and ``group`` quantized value rows, so the quantize work per step is O(new tokens).

Eviction inside quantized groups: a kept token keeps its codes and its group's key scale and zero; a group's metadata is
freed once no head keeps any of its tokens. Once eviction has thinned groups, each head records how many tokens
every group still holds (int16, counted as metadata) so a token finds its group. Heads may keep different numbers of
quantized tokens; the quantized region is cut to the smallest count and the other heads' extra quantized tokens move
to the residual as their dequantized values (so they cost full-precision bytes until the residual flushes again).

Attention reads dequantized keys and values (a simulated kernel): a dense buffer that grows in place holds the
dequantized quantized region followed by the residual, so decoding writes only the new token and a flush overwrites
only its group; ``nbytes`` counts what a real kernel would hold: packed codes, fp16 scales and zeros, group sizes
and the full-precision residual (the buffer's tail).
"""

from __future__ import annotations

import torch

from kvviz.cache.protocol import QuantizationMethod, per_element
from kvviz.cache.quant import Quantized, bits_with_metadata, channel_groups, quantize_per_channel, quantize_per_token
from kvviz.cache.quantized import refuse_rerotation
from kvviz.cache.spec import MethodStack, Param, register
from kvviz.cache.storage import DenseStorage, KVStorage, StorageBytes, gather_tokens, tensor_bytes


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


class GroupQuantStorage(KVStorage):
    """Packed group-wise quantized K/V with a full-precision residual; keys per channel (KIVI) or per token."""

    def __init__(self, bits: int, group: int, residual: int, keys_per_channel: bool):
        self.bits, self.group, self.residual = bits, group, residual
        self.keys_per_channel = keys_per_channel
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.group_sizes: torch.Tensor | None = None  # [B, H, G] int16 once eviction thinned key groups
        self.read = DenseStorage()  # what attention reads: the dequantized quantized region, then the residual
        self.key_dim = self.value_dim = 0  # MLA models cache keys and values of different widths
        self.dtype = torch.float32

    # -- protocol ---------------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.key_dim, self.value_dim, self.dtype = keys.shape[-1], values.shape[-1], keys.dtype
        self.read.append(keys, values)
        self._flush()

    def keep(self, index: torch.Tensor) -> None:
        quantized = self.quantized_length
        if quantized:
            cut = int((index < quantized).sum(-1).min())  # every head keeps at least this many quantized tokens
            kept = index[..., :cut]  # the rest (other heads' extra quantized tokens) joins the residual, dequantized
            groups = self._group_of_slot() if self.keys_per_channel else None
            self.keys = self._gather(self.keys, kept, per_token=not self.keys_per_channel)
            self.values = self._gather(self.values, kept, per_token=True)
            if groups is not None:
                self._regroup(gather_tokens(groups, kept))
        self.read.keep(index)
        self._flush()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read.materialize()

    def __len__(self) -> int:
        return len(self.read)

    def nbytes(self) -> StorageBytes:
        codes = tensor_bytes(*(q.codes for q in (self.keys, self.values) if q is not None))
        metadata = tensor_bytes(*(t for q in (self.keys, self.values) if q is not None for t in (q.scale, q.zero)),
                                self.group_sizes)
        return StorageBytes(codes=codes, metadata=metadata, full_precision=tensor_bytes(*self.residual_entries()))

    # -- internals --------------------------------------------------------------------------------------------
    @property
    def quantized_length(self) -> int:
        return 0 if self.keys is None else self.keys.codes.shape[2]

    @property
    def residual_length(self) -> int:
        return len(self.read) - self.quantized_length

    def residual_entries(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The full-precision residual's keys and values (the read buffer's tail)."""
        if not len(self.read):
            return None, None
        keys, values = self.read.materialize()
        start = self.quantized_length
        return keys[:, :, start:], values[:, :, start:]

    def _flush(self) -> None:
        """Quantize the oldest whole groups beyond the newest ``residual`` tokens (touches only those tokens)."""
        groups = (self.residual_length - self.residual) // self.group
        if groups <= 0:
            return
        count, start = groups * self.group, self.quantized_length
        res_keys, res_values = self.residual_entries()
        keys, values = res_keys[:, :, :count], res_values[:, :, :count]
        if self.keys_per_channel:
            new_keys, dequant = quantize_per_channel(keys, self.bits, self.group, self.dtype)
            if self.group_sizes is not None:
                full = torch.full((*keys.shape[:2], groups), self.group, dtype=torch.int16, device=keys.device)
                self.group_sizes = torch.cat([self.group_sizes, full], dim=2)
        else:
            new_keys, dequant = quantize_per_token(keys, self.bits, self.group, self.dtype)
        new_values, dequant_values = quantize_per_token(values, self.bits, self.group, self.dtype)
        self.keys = self._append(self.keys, new_keys)
        self.values = self._append(self.values, new_values)
        self.read.overwrite(start, dequant, dequant_values)

    @staticmethod
    def _append(old: Quantized | None, new: Quantized) -> Quantized:
        if old is None:
            return new
        return Quantized(_cat(old.codes, new.codes), _cat(old.scale, new.scale), _cat(old.zero, new.zero))

    @staticmethod
    def _gather(q: Quantized, index: torch.Tensor, per_token: bool) -> Quantized:
        """Keep tokens ``index``: codes always follow the token axis; per-token scales and zeros too."""
        if not per_token:
            return Quantized(gather_tokens(q.codes, index), q.scale, q.zero)
        return Quantized(gather_tokens(q.codes, index), gather_tokens(q.scale, index), gather_tokens(q.zero, index))

    def _group_of_slot(self) -> torch.Tensor:
        """[B, H, Tq] the key group (row of scale/zero) each quantized slot belongs to."""
        batch, heads = self.keys.codes.shape[:2]
        slots = torch.arange(self.quantized_length, device=self.keys.codes.device).expand(batch, heads, -1)
        if self.group_sizes is None:
            return slots // self.group
        ends = self.group_sizes.long().cumsum(-1).contiguous()
        return torch.searchsorted(ends, slots.contiguous(), right=True)

    def _regroup(self, groups: torch.Tensor) -> None:
        """After eviction: count the tokens left in each key group per head and drop groups no head uses."""
        batch, heads = groups.shape[:2]
        total = self.keys.scale.shape[2]
        sizes = torch.zeros(batch, heads, total, dtype=torch.long, device=groups.device)
        sizes.scatter_add_(-1, groups, torch.ones_like(groups))
        used = sizes.sum(dim=(0, 1)) > 0
        sizes = sizes[..., used]
        self.keys = Quantized(self.keys.codes, self.keys.scale[:, :, used], self.keys.zero[:, :, used])
        self.group_sizes = None if bool((sizes == self.group).all()) else sizes.to(torch.int16)


class GroupQuantMethod(QuantizationMethod):
    """Shared by KIVI and the per-token baseline: parameters, storage and the stacking rule."""

    keys_per_channel = True
    sized_by = "bits"

    def new_storage(self, layer_idx: int) -> GroupQuantStorage:
        return GroupQuantStorage(self.bits, self.group, self.residual, self.keys_per_channel)

    def bits_per_element(self, head_dim: int, value_dim: int | None = None) -> float:
        value_dim = value_dim or head_dim
        keys = self.bits_per_channel() if self.keys_per_channel else self.bits_per_token(head_dim)
        return per_element(keys * head_dim, self.bits_per_token(value_dim) * value_dim, head_dim, value_dim)

    def bits_per_channel(self) -> float:
        """Bits per element of a key quantized per channel: each channel's scale and zero shared by ``group`` tokens."""
        return bits_with_metadata(self.bits, self.group)

    def bits_per_token(self, dim: int) -> float:
        """Bits per element of a ``dim``-wide vector quantized on its own in groups of ``group`` channels."""
        return bits_with_metadata(self.bits, dim / len(set(channel_groups(dim, self.group).tolist())))

    def check_stack(self, stack: MethodStack) -> None:
        refuse_rerotation(self, stack)


BITS = Param("bits", int, 2, "bits per stored code", choices=(2, 4, 8))
GROUP = Param("group", int, 32, "tokens per key group and channels per value group (one fp16 scale and zero each)",
              min=4, max=1024)
RESIDUAL = Param("residual", int, 128, "newest tokens kept in full precision before they are flushed into groups",
                 min=0, max=65536)


@register
class Kivi(GroupQuantMethod):
    name = "kivi"
    summary = ("KIVI: keys quantized per channel over groups of tokens, values per token; the newest tokens stay in "
               "full precision.")
    params = (BITS, GROUP, RESIDUAL)
