"""A low-rank latent (MLA-like): cache R numbers per layer and token for the keys and R_v for the values.

Per layer, the keys of all KV heads of a token (``kv_heads * head_dim`` numbers, taken before RoPE: the incoming keys
are rotated back by their known positions) are projected on the top ``rank`` principal directions, and the values on
the top ``v_rank``. Attention reads K/V reconstructed from the latent, with RoPE applied again at each entry's
position, so the latent itself is position-free and eviction never has to touch it.

Calibration: the projections are the principal components (uncentred, like MLA's bias-free down-projection) of the
layer's pre-RoPE keys and of its values over the prompt itself, computed when the cache is forked from the prefill.
The prompt is what the cache is about to hold, so it fits this text best, needs no shipped calibration file, and
costs one small eigendecomposition per layer; generated tokens are projected with the same basis.

Bytes: the latent is the cache, ``(rank + v_rank) / (2 * kv_heads * head_dim)`` of full; the projections
(``kv_heads * head_dim * (rank + v_rank)`` numbers per layer) are weights, reported separately. At
``rank = v_rank = kv_heads * head_dim`` the basis is complete and the output equals full token for token.

This is NOT DeepSeek's MLA: real MLA is trained with its latent and carries RoPE on a separate decoupled key part,
so nothing is lost to a post-hoc fit. This is a post-hoc approximation of a trained MHA/GQA model, in the spirit of
Palu (Chang et al. 2024) and MHA2MLA (Ji et al. 2025), without their fine-tuning.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvviz.cache.architecture import ArchitectureStorage
from kvviz.cache.protocol import ArchitectureMethod
from kvviz.cache.spec import MethodStack, Param, Sizing, SpecError, register
from kvviz.cache.storage import KeptRanges, KVStorage, gather_tokens, take_ranges, tensor_bytes

_BASES: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # a covariance's digest -> its eigenvectors, newest last
BASES_KEPT = 128  # two per layer (keys, values) of a few prompts: a sweep over ranks decomposes each layer once


def principal_directions(samples: torch.Tensor, rank: int) -> torch.Tensor:
    """[features, rank] orthonormal directions of largest uncentred variance of ``samples`` [N, features].

    The eigendecomposition of the feature covariance always returns a complete basis, so a full rank reconstructs
    exactly even when the prompt has fewer tokens than features. Every rank of one prompt reads the same basis, so
    the decomposition is kept by the covariance's content (a digest of its bytes) and reused.
    """
    data = samples.double()
    covariance = data.T @ data
    digest = hashlib.sha256(covariance.cpu().numpy().tobytes()).digest()
    vectors = _BASES.get(digest)
    if vectors is None:
        vectors = torch.linalg.eigh(covariance)[1].flip(-1)  # eigh: ascending eigenvalues
        _BASES[digest] = vectors
        while len(_BASES) > BASES_KEPT:
            _BASES.popitem(last=False)
    _BASES.move_to_end(digest)
    return vectors[:, :rank]


class LatentStorage(ArchitectureStorage):
    """Holds one latent 'head' per token in ``inner``: keys [B, 1, T, rank], values [B, 1, T, v_rank]."""

    def __init__(self, inner: KVStorage, rank: int, v_rank: int, cache):
        super().__init__(inner)
        self.rank, self.v_rank = rank, v_rank
        self.cache = cache  # gives the rotary positions of appended tokens and the model's RoPE
        self.key_basis: torch.Tensor | None = None  # [kv_heads * head_dim, rank]
        self.value_basis: torch.Tensor | None = None
        self.rotary: torch.Tensor | None = None  # [T] rotary position of every cached entry
        self.heads = self.key_dim = self.value_dim = 0

    def cache_heads(self, model_heads: int) -> int:
        return 1

    def calibrate(self, keys: torch.Tensor, values: torch.Tensor, rotary: torch.Tensor) -> None:
        self.heads, self.key_dim, self.value_dim = keys.shape[1], keys.shape[-1], values.shape[-1]
        if self.key_dim != 2 * self.cache.rotate_keys.inv_freq.numel():
            raise SpecError(f"lowrank rebuilds keys whose every channel carries RoPE; this model rotates "
                            f"{2 * self.cache.rotate_keys.inv_freq.numel()} of {self.key_dim} key channels "
                            "(decoupled RoPE, as MLA models do)")
        flat_keys = self._flatten(self._rotate(keys, rotary, undo=True))
        self.key_basis = principal_directions(flat_keys, self.rank).to(keys.dtype)
        self.value_basis = principal_directions(self._flatten(values), self.v_rank).to(values.dtype)

    def weight_bytes(self) -> int:
        return tensor_bytes(self.key_basis, self.value_basis)

    def compress(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.cache.step_rotary.to(keys.device)
        self.rotary = rotary.clone() if self.rotary is None else torch.cat([self.rotary, rotary])
        batch, length = keys.shape[0], keys.shape[2]
        latent_keys = self._flatten(self._rotate(keys, rotary, undo=True)) @ self.key_basis
        latent_values = self._flatten(values) @ self.value_basis
        return latent_keys.view(batch, 1, length, self.rank), latent_values.view(batch, 1, length, self.v_rank)

    def expand(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre_rope = self._unflatten(keys @ self.key_basis.T)
        return self._rotate(pre_rope, self.rotary, undo=False), self._unflatten(values @ self.value_basis.T)

    def on_keep(self, index: torch.Tensor | None, kept: KeptRanges | None) -> None:
        if kept is not None:
            self.rotary = take_ranges(self.rotary, kept.spans, 0)
        else:
            self.rotary = gather_tokens(self.rotary.view(1, 1, -1), index[:1, :1]).flatten()

    # -- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _flatten(x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] -> [B * T, H * D]: one row per token, every head's channels side by side."""
        return x.transpose(1, 2).flatten(2).flatten(0, 1)

    def _unflatten(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, H * D] -> [B, H, T, D]."""
        batch, _, length, width = x.shape
        return x.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

    def _rotate(self, keys: torch.Tensor, rotary: torch.Tensor, undo: bool) -> torch.Tensor:
        """Apply RoPE at positions ``rotary`` [T] (or undo it) with the model's frequencies."""
        angle = -rotary if undo else rotary
        cos, sin = self.cache.rotate_keys.angles(angle, keys.dtype)
        return self.cache.rotate_keys.apply(keys, cos.to(keys.device), sin.to(keys.device))


@register
class LowRank(ArchitectureMethod):
    name = "lowrank"
    summary = ("MLA-like: cache a rank-R latent of each token's pre-RoPE keys (and values) per layer, from the "
               "prompt's principal components; K/V are rebuilt and RoPE re-applied for attention. Post-hoc, untrained.")
    params = (
        Param("rank", int, 96, "latent size for the keys, at most kv_heads * head_dim (192 on SmolLM2-135M)",
              min=1, max=65536),
        Param("v_rank", int, 0, "latent size for the values; 0 = the same as rank", min=0, max=65536),
    )
    sized_by = "rank"

    @classmethod
    def sweep_points(cls, shares: Sequence[float], sizing: Sizing,
                     fixed: dict[str, Any]) -> list[tuple[float, LowRank]]:
        """The rank holding each share of the model's ``kv_heads * head_dim`` elements per token and layer."""
        width = sizing.kv_heads * sizing.head_dim
        points = []
        for share in shares:
            method = cls(**(fixed | {"rank": max(1, round(share * width))}))
            points.append((method.cache_fraction(sizing.kv_heads, sizing.head_dim), method))
        return points

    @property
    def value_rank(self) -> int:
        return self.v_rank or self.rank

    def check_model(self, kv_heads: int, head_dim: int) -> None:
        largest = kv_heads * head_dim
        for key, value in (("rank", self.rank), ("v_rank", self.value_rank)):
            if value > largest:
                raise SpecError(f"lowrank:{key}={value} is above this model's kv_heads * head_dim = {largest}; "
                                f"choose 1..{largest}")

    def check_stack(self, stack: MethodStack) -> None:
        super().check_stack(stack)
        if stack.eviction is not None and stack.eviction.rerotate:
            raise SpecError(f"'{stack.eviction.spec()}' re-rotates cached keys; lowrank stores them before RoPE, "
                            "use rerotate=0")
        if stack.quantization is not None and self.value_rank != self.rank:
            raise SpecError(f"{stack.quantization.name} stores keys and values of one size; give lowrank "
                            f"v_rank={self.rank} (or leave it out) when quantizing")

    def cache_heads(self, kv_heads: int) -> int:
        return 1

    def cache_fraction(self, kv_heads: int, head_dim: int) -> float:
        return (self.rank + self.value_rank) / (2 * kv_heads * head_dim)

    def stored_dim(self, kv_heads: int, head_dim: int) -> int:
        return self.rank

    def wrap_storage(self, layer_idx: int, inner: KVStorage, cache) -> LatentStorage:
        if cache.rotate_keys is None:
            raise SpecError("lowrank needs the model's rotary embedding (rotary_emb.inv_freq) to undo RoPE")
        return LatentStorage(inner, self.rank, self.value_rank, cache)
