"""A transformers Cache whose layers apply a method stack: which entries stay (eviction) and how they are stored.

Positions: every stored entry remembers its absolute token position (for the ledger and the UI) and the rotary
position its key currently carries. The model is called with ``cache_position`` counting stored entries (so masks
line up with the compacted cache) and ``position_ids`` from :meth:`KVCache.next_rotary_positions` (absolute
positions, or in-cache positions when a method re-rotates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvviz.ledger import EvictionLedger
from kvviz.methods.base import EvictionMethod, LayerView, MethodStack
from kvviz.storage import DenseStorage, KVStorage, StorageBytes

RotateKeys = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (keys, position deltas [B,H,T]) -> keys


class KVLayer(CacheLayerMixin):
    """One layer's cache: a storage, the positions of its entries, and the eviction method's state."""

    is_sliding = False

    def __init__(self, layer_idx: int, owner: KVCache, storage: KVStorage, eviction: EvictionMethod | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.storage = storage
        self.eviction = eviction
        self.state = eviction.new_state(layer_idx) if eviction is not None else None
        self.positions: torch.Tensor | None = None  # [B, H_kv, T] absolute positions
        self.rotary: torch.Tensor | None = None  # [B, H_kv, T] positions the keys are rotated to

    # -- transformers' layer protocol -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, new = key_states.shape[:3]
        absolute = self.owner.step_positions.to(key_states.device).view(1, 1, new).expand(batch, heads, new)
        rotary = self.owner.step_rotary.to(key_states.device).view(1, 1, new).expand(batch, heads, new)
        self.storage.append(key_states, value_states)
        self.positions = absolute.clone() if self.positions is None else torch.cat([self.positions, absolute], -1)
        self.rotary = rotary.clone() if self.rotary is None else torch.cat([self.rotary, rotary], -1)
        if self.owner.decoding and self.eviction is not None and not self.eviction.scores_attention:
            # the new tokens' queries already carry rotary positions; re-rotated keys must end where they stand
            self.apply_keep(self.eviction.select(self.view()), rotary_end=int(self.owner.step_rotary.max()) + 1)
        return self.storage.materialize()

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return len(self.storage) + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return len(self.storage)

    def get_max_cache_shape(self) -> int:
        return -1

    # -- kvviz ------------------------------------------------------------------------------------------------
    def view(self, attention: torch.Tensor | None = None) -> LayerView:
        keys, values = self.storage.materialize()
        return LayerView(
            layer_idx=self.layer_idx,
            positions=self.positions,
            keys=keys,
            prompt_length=self.owner.prompt_length,
            step=self.owner.step,
            attention=attention,
            state=self.state,
            values=values,
        )

    def apply_keep(self, index: torch.Tensor | None, rotary_end: int | None = None) -> None:
        """Keep entries ``index`` [B, H, n]; record the rest in the ledger; re-rotate keys if the method asks.

        ``rotary_end``: one past the rotary position re-rotated keys must end at (the in-flight queries' position);
        by default the cache length, so the next token (given rotary position ``len(cache)``) follows on.
        """
        if index is None:
            return
        keep_mask = torch.zeros_like(self.positions, dtype=torch.bool).scatter_(-1, index, True)
        if self.owner.ledger is not None:
            removed = self.positions[0][~keep_mask[0]].view(self.positions.shape[1], -1)
            self.owner.ledger.record(self.layer_idx, self.owner.step, removed)
        self.storage.keep(index)
        self.positions = self.positions.gather(-1, index)
        self.rotary = self.rotary.gather(-1, index)
        if self.eviction is not None and self.eviction.rerotate:
            self._rerotate(self.rotary.shape[-1] if rotary_end is None else rotary_end)

    def _rerotate(self, end: int) -> None:
        """Give cached keys consecutive rotary positions ending at ``end - 1`` (StreamingLLM's position shift).

        Only distances matter to RoPE: a query at position p then sees the key i entries back at distance i, as if
        the evicted tokens had never existed.
        """
        length = self.rotary.shape[-1]
        target = torch.arange(end - length, end, device=self.rotary.device).expand_as(self.rotary)
        delta = target - self.rotary
        changed = (delta != 0).flatten(0, 1).any(dim=0).nonzero().flatten()
        if changed.numel() == 0:
            return
        keys, _ = self.storage.materialize()
        if changed.numel() == length:
            keys = self.owner.rotate_keys(keys, delta)
        else:  # typically only the sinks move: rotate those few entries, copy the rest
            keys = keys.index_copy(2, changed, self.owner.rotate_keys(keys[:, :, changed], delta[:, :, changed]))
        self.storage.replace_keys(keys)
        self.rotary = target.clone()

    def nbytes(self) -> StorageBytes:
        return self.storage.nbytes()


class KVCache(Cache):
    """The cache kvviz replays with: one :class:`KVLayer` per decoder layer, a shared step context, a ledger."""

    def __init__(
        self,
        num_layers: int,
        stack: MethodStack | None = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: RotateKeys | None = None,
    ):
        self.stack = stack or MethodStack()
        self.ledger = ledger
        self.rotate_keys = rotate_keys
        self.prompt_length = 0
        self.step = 0
        self.decoding = False
        self.step_positions = torch.zeros(0, dtype=torch.long)
        self.step_rotary = torch.zeros(0, dtype=torch.long)
        quantization, eviction = self.stack.quantization, self.stack.eviction
        layers = [
            KVLayer(i, self, quantization.new_storage(i) if quantization else DenseStorage(), eviction)
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)

    @property
    def rerotates(self) -> bool:
        return self.stack.eviction is not None and self.stack.eviction.rerotate

    def next_rotary_positions(self, absolute: torch.Tensor) -> torch.Tensor:
        """Rotary positions for new tokens: absolute, or right after the cache's last key when keys are re-rotated.

        Re-rotated positions stay consecutive (see :meth:`KVLayer._rerotate`) but are not reset to zero each step:
        RoPE only sees distances, so sliding them forward costs nothing and keeps in-flight queries valid.
        """
        if self.rerotates and self.layers[0].rotary is not None:
            return torch.arange(absolute.numel()) + int(self.layers[0].rotary.max()) + 1
        return absolute

    def begin_forward(self, absolute: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Set the positions of the tokens about to be fed; return (position_ids, cache_position) for the model."""
        self.step = step
        self.step_positions = absolute.cpu()
        self.step_rotary = self.next_rotary_positions(absolute.cpu())
        stored = self.get_seq_length()
        cache_position = torch.arange(stored, stored + absolute.numel())
        return self.step_rotary.unsqueeze(0), cache_position

    # -- attention listener: methods that score entries by the current query's attention -------------------------
    def wants(self, layer_idx: int) -> bool:
        return self.decoding and self.stack.eviction is not None and self.stack.eviction.scores_attention

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None:
        layer = self.layers[layer_idx]
        layer.apply_keep(layer.eviction.select(layer.view(attention=probs)))

    # -- prefill and forking ----------------------------------------------------------------------------------
    @classmethod
    def fork(
        cls,
        prefill: KVCache,
        stack: MethodStack,
        stats: Any = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: RotateKeys | None = None,
    ) -> KVCache:
        """A new cache holding ``prefill``'s entries under ``stack``: stored its way, compressed by its eviction.

        ``prefill`` is a dense cache after the prompt's forward; it is not modified, so many methods can fork it.
        """
        cache = cls(len(prefill.layers), stack, ledger, rotate_keys)
        cache.prompt_length = prefill.prompt_length
        cache.step = 0
        for source, layer in zip(prefill.layers, cache.layers, strict=True):
            keys, values = source.storage.materialize()
            layer.lazy_initialization(keys, values)
            layer.storage.append(keys, values)
            layer.positions, layer.rotary = source.positions.clone(), source.rotary.clone()
            if layer.eviction is not None:
                layer.apply_keep(layer.eviction.prefill_select(layer.view(), stats))
        cache.decoding = True
        return cache

    def nbytes(self) -> StorageBytes:
        total = StorageBytes()
        for layer in self.layers:
            total = total + layer.nbytes()
        return total

    def nbytes_per_layer(self) -> list[int]:
        return [layer.nbytes().total for layer in self.layers]

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """[H_kv, T] absolute positions cached in a layer right now (batch 0)."""
        return self.layers[layer_idx].positions[0]


def rope_rotator(model: torch.nn.Module) -> RotateKeys | None:
    """A function that rotates cached keys by per-entry position deltas with the model's own rotary embedding."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        return None

    def rotate(keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        batch, heads, length, dim = keys.shape
        cos, sin = rotary(keys, delta.reshape(batch, heads * length))
        scale = getattr(rotary, "attention_scaling", 1.0) or 1.0  # cos/sin come pre-scaled for some RoPE types
        cos = (cos / scale).view(batch, heads, length, dim).to(keys.dtype)
        sin = (sin / scale).view(batch, heads, length, dim).to(keys.dtype)
        half = dim // 2
        rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
        return keys * cos + rotated_half * sin

    return rotate

