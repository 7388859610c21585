"""transformers' own quantized KV cache (``QuantizedCache`` layers, quanto or HQQ backend) as the ecosystem reference.

The storage drives one transformers ``QuantoQuantizedLayer`` / ``HQQQuantizedLayer`` unchanged, so its policy is
transformers' own, not KIVI's: keys and values are quantized the same way (axis 0, groups of ``group`` elements), the
prompt is quantized whole at prefill, new tokens collect in a full-precision residual and, when it holds ``residual``
tokens, the whole cache is dequantized and quantized again (O(cache) work at each flush).

That layer holds the quantized cache as one backend tensor and cannot drop tokens, so this method refuses to stack
with eviction (use kivi, per_token or bnb for that). Missing backends are reported as a one-line SpecError.
"""

from __future__ import annotations

import importlib.util

import torch

from kvviz.cache.protocol import QuantizationMethod
from kvviz.cache.quant import bits_with_metadata
from kvviz.cache.spec import MethodStack, Param, SpecError, register
from kvviz.cache.storage import KVStorage, StorageBytes, tensor_bytes

BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto", (2, 4)), "hqq": ("hqq", "hqq", (1, 2, 3, 4, 8))}


def _backend_tensors(quantized) -> list[torch.Tensor]:
    """The plain tensors a backend's quantized object holds (quanto QTensor subclasses or HQQ's (codes, meta))."""
    if isinstance(quantized, torch.Tensor) and hasattr(quantized, "__tensor_flatten__"):
        names, _ = quantized.__tensor_flatten__()
        return [t for name in names for t in _backend_tensors(getattr(quantized, name))]
    if isinstance(quantized, torch.Tensor):
        return [quantized]
    if isinstance(quantized, (tuple, list)):
        return [t for item in quantized for t in _backend_tensors(item)]
    if isinstance(quantized, dict):
        return [t for item in quantized.values() for t in _backend_tensors(item)]
    return []


def _codes_and_metadata(quantized) -> tuple[int, int]:
    """Bytes of integer tensors (codes) and of floating tensors (scales, zeros) in a backend's quantized object."""
    tensors = _backend_tensors(quantized)
    codes = tensor_bytes(*(t for t in tensors if not t.is_floating_point()))
    return codes, tensor_bytes(*(t for t in tensors if t.is_floating_point()))


class HFQuantizedStorage(KVStorage):
    """Wraps one transformers quantized cache layer; dequantizes only when it re-quantizes."""

    def __init__(self, layer):
        self.layer = layer
        self._source = None  # the backend key tensor the dequantized copy below was made from
        self._dequant: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.layer.update(keys, values)

    def keep(self, index: torch.Tensor) -> None:
        raise SpecError("hf_quantized cannot drop tokens: transformers' quantized layer stores the cache as one tensor")

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layer
        if self._source is not layer._quantized_keys:
            keys = layer._dequantize(layer._quantized_keys).to(layer.dtype)
            self._dequant = keys, layer._dequantize(layer._quantized_values).to(layer.dtype)
            self._source = layer._quantized_keys
        keys, values = self._dequant
        if layer.keys.dim() == 4 and layer.keys.shape[2]:
            return torch.cat([keys, layer.keys], 2), torch.cat([values, layer.values], 2)
        return keys, values

    def __len__(self) -> int:
        return self.layer.get_seq_length() if self.layer.is_initialized else 0

    def nbytes(self) -> StorageBytes:
        if not self.layer.is_initialized:
            return StorageBytes()
        key_codes, key_meta = _codes_and_metadata(self.layer._quantized_keys)
        value_codes, value_meta = _codes_and_metadata(self.layer._quantized_values)
        residual = tensor_bytes(self.layer.keys, self.layer.values) if self.layer.keys.dim() == 4 else 0
        return StorageBytes(codes=key_codes + value_codes, metadata=key_meta + value_meta, full_precision=residual)


@register
class HFQuantized(QuantizationMethod):
    name = "hf_quantized"
    summary = ("transformers' QuantizedCache layers (quanto or HQQ backend), the ecosystem's reference: keys and "
               "values quantized alike, whole cache re-quantized when the residual fills.")
    params = (
        Param("backend", str, "quanto", "transformers' quantization backend", choices=tuple(BACKENDS)),
        Param("nbits", int, 4, "bits per code (quanto: 2|4; hqq: 1|2|3|4|8)", choices=(1, 2, 3, 4, 8)),
        Param("group", int, 64, "elements per quantization group (q_group_size)", min=8, max=1024),
        Param("residual", int, 128, "full-precision tokens collected before the cache is re-quantized",
              min=1, max=65536),
    )
    sized_by = "nbits"

    def validate(self) -> None:
        allowed = BACKENDS[self.backend][2]
        if self.nbits not in allowed:
            choices = "|".join(str(b) for b in allowed)
            raise SpecError(f"bad value in 'hf_quantized:nbits={self.nbits}': {self.backend} takes {choices}")

    def check_stack(self, stack: MethodStack) -> None:
        if stack.eviction is not None and stack.eviction.name != "full":
            raise SpecError(f"hf_quantized cannot stack with '{stack.eviction.spec()}': transformers' quantized layer "
                            "cannot drop tokens; use kivi, per_token or bnb with eviction")

    def new_storage(self, layer_idx: int) -> HFQuantizedStorage:
        module, package, _ = BACKENDS[self.backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise SpecError(f"hf_quantized:backend={self.backend} needs the '{package}' package, which is not "
                            f"installed (pip install {package})")
        from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

        layer_class = QuantoQuantizedLayer if self.backend == "quanto" else HQQQuantizedLayer
        return HFQuantizedStorage(layer_class(nbits=self.nbits, q_group_size=self.group,
                                              residual_length=self.residual))

    def bits_per_element(self, head_dim: int, value_dim: int | None = None) -> float:
        # groups of elements whatever the key and value widths; scale and zero at a 16-bit compute dtype (a float32
        # model keeps them in float32, twice the metadata)
        return bits_with_metadata(self.nbits, self.group)

