"""Quantization diagnostics for the UI: what each method loses (reconstruction error) and why KIVI's asymmetry helps
(outlier key channels). Where the bytes go is in each result's ``kv_breakdown``.

Everything here works on a prompt's dense prefill K/V (:func:`prefill_kv`), so one prefill serves every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvviz.methods import MethodStack, QuantizationMethod, SpecError, parse_spec

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, H_kv, T, D]


def prefill_kv(session) -> list[LayerKV]:
    """The dense K/V of every layer after a :class:`kvviz.comparison.session.PromptSession`'s prefill."""
    return [layer.storage.materialize() for layer in session.prefill().cache.layers]


def _quantization(method: str | MethodStack | QuantizationMethod) -> QuantizationMethod:
    if isinstance(method, QuantizationMethod):
        return method
    stack = parse_spec(method) if isinstance(method, str) else method
    if stack.quantization is None:
        raise SpecError(f"'{stack.label}' has no quantization method to diagnose")
    return stack.quantization


def _relative(error: torch.Tensor, reference: torch.Tensor) -> float:
    return float(error.float().norm() / reference.float().norm().clamp_min(1e-12))


@dataclass
class ReconstructionError:
    """Per layer: ||K' - K|| / ||K|| and the same for V, over the tokens attention reads (residual included)."""

    method: str
    key: list[float]
    value: list[float]
    quantized_tokens: list[int]  # tokens per layer held as codes (the rest sit in a full-precision residual)


def reconstruction_error(kv: Sequence[LayerKV], method: str | MethodStack | QuantizationMethod) -> ReconstructionError:
    """Store each layer's K/V with ``method`` and compare what attention would read with the original."""
    quantization = _quantization(method)
    keys_error, values_error, quantized = [], [], []
    for layer_idx, (keys, values) in enumerate(kv):
        storage = quantization.new_storage(layer_idx)
        storage.append(keys, values)
        stored_keys, stored_values = storage.materialize()
        keys_error.append(_relative(stored_keys - keys, keys))
        values_error.append(_relative(stored_values - values, values))
        per_token = (keys[:, :, :1].numel() + values[:, :, :1].numel()) * keys.element_size()  # one token's K and V
        quantized.append(len(storage) - storage.nbytes().full_precision // per_token)
    return ReconstructionError(quantization.spec(), keys_error, values_error, quantized)


@dataclass
class ChannelStats:
    """Key magnitude per channel: [layers, H_kv, D] absolute maximum and mean over tokens.

    ``outlier_ratio`` per layer: the largest channel's absmax over the median channel's (a few channels far above
    the rest is what per-token quantization suffers from and per-channel quantization absorbs).
    """

    absmax: torch.Tensor
    mean_abs: torch.Tensor
    outlier_ratio: list[float]

    def top_channels(self, layer: int, count: int = 4) -> list[tuple[int, int, float]]:
        """(head, channel, absmax) of the ``count`` largest channels of a layer."""
        flat = self.absmax[layer].flatten()
        top = flat.topk(min(count, flat.numel()))
        dim = self.absmax.shape[-1]
        return [(int(i) // dim, int(i) % dim, float(v)) for v, i in zip(top.values, top.indices, strict=True)]


def key_channel_stats(kv: Sequence[LayerKV]) -> ChannelStats:
    """Per-channel key magnitudes of every layer (batch 0)."""
    absmax = torch.stack([keys[0].float().abs().amax(dim=1) for keys, _ in kv])
    mean_abs = torch.stack([keys[0].float().abs().mean(dim=1) for keys, _ in kv])
    per_layer = absmax.flatten(1)
    ratio = (per_layer.amax(dim=1) / per_layer.median(dim=1).values.clamp_min(1e-12)).tolist()
    return ChannelStats(absmax, mean_abs, ratio)


@dataclass
class QuantizationReport:
    """What a comparison's quantizers do to its prompt: error per method and layer, and the key channels' sizes."""

    errors: dict[str, ReconstructionError]
    key_channels: ChannelStats


def quantization_report(kv: Sequence[LayerKV], stacks: Sequence[MethodStack]) -> QuantizationReport | None:
    """Diagnose every stack that quantizes, on the prefill K/V already computed (no second forward); None when
    none does. A quantizer that cannot run here (a missing backend) is left out; its replay reports why."""
    errors, by_quantizer = {}, {}  # stacks quantizing the same way (kivi:bits=2 alone and after SnapKV) share one
    for stack in stacks:
        if stack.quantization is not None:
            quantizer = stack.quantization.spec()
            if quantizer not in by_quantizer:
                try:
                    by_quantizer[quantizer] = reconstruction_error(kv, stack)
                except (ImportError, RuntimeError, SpecError):
                    by_quantizer[quantizer] = None
            if by_quantizer[quantizer] is not None:
                errors[stack.label] = by_quantizer[quantizer]
    return QuantizationReport(errors, key_channel_stats(kv)) if errors else None
