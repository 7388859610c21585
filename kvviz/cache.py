"""A transformers Cache whose layers apply a method stack: which entries stay (eviction) and how they are stored.

Positions: every stored entry remembers its absolute token position (for the ledger and the UI) and the rotary
position its key currently carries. The model is called with ``cache_position`` counting stored entries (so masks
line up with the compacted cache) and ``position_ids`` from :meth:`KVCache.next_rotary_positions` (absolute
positions, or in-cache positions when a method re-rotates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvviz.capture import block_keys
from kvviz.ledger import EvictionLedger
from kvviz.methods.base import EvictionMethod, LayerView, MethodStack
from kvviz.storage import DenseStorage, KeptRanges, KVStorage, StorageBytes, take_ranges


@dataclass
class Rerotation:
    """The rotary positions keys end at (``target`` [T]), the entries whose keys move (``changed``) and the cos/sin
    of their rotation."""

    target: torch.Tensor
    changed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


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
        self.blocked: torch.Tensor | None = None  # [B, H_kv, T] entries held but never attended (see block)

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
            self.apply_keep(self.eviction.select(self.view()), rotary_end=self.owner.step_rotary_end)
        if self.blocked is not None:
            self.blocked = torch.cat([self.blocked, self.blocked.new_zeros(batch, heads, new)], -1)
        block_keys(self.layer_idx, self.blocked)
        return self.storage.materialize()

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return len(self.storage) + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return len(self.storage)

    def get_max_cache_shape(self) -> int:
        return -1

    # -- kvviz ------------------------------------------------------------------------------------------------
    def view(self, attention: torch.Tensor | None = None) -> LayerView:
        return LayerView(
            layer_idx=self.layer_idx,
            positions=self.positions,
            entries=self.storage.materialize,
            prompt_length=self.owner.prompt_length,
            step=self.owner.step,
            attention=attention,
            state=self.state,
        )

    def apply_keep(self, kept: torch.Tensor | KeptRanges | None, rotary_end: int | None = None) -> None:
        """Keep entries ``kept`` (an index [B, H, n] or ranges every head keeps); record the rest in the ledger;
        re-rotate keys if the method asks.

        ``rotary_end``: one past the rotary position re-rotated keys must end at (the in-flight queries' position);
        by default the cache length, so the next token (given rotary position ``len(cache)``) follows on.
        """
        if kept is None:
            return
        if isinstance(kept, KeptRanges):
            if self.owner.ledger is not None:
                gaps = kept.dropped(self.positions.shape[-1])
                if gaps:
                    self.owner.ledger.record(self.layer_idx, self.owner.step, take_ranges(self.positions[0], gaps, -1))
            self.storage.keep_ranges(kept)
            self.positions = take_ranges(self.positions, kept.spans, -1)
            self.rotary = take_ranges(self.rotary, kept.spans, -1)
        else:
            if self.owner.ledger is not None:
                dropped = torch.ones_like(self.positions[0], dtype=torch.bool).scatter_(-1, kept[0], False)
                removed = self.positions[0][dropped].view(self.positions.shape[1], -1)
                self.owner.ledger.record(self.layer_idx, self.owner.step, removed)
            self.storage.keep(kept)
            self.positions = self.positions.gather(-1, kept)
            self.rotary = self.rotary.gather(-1, kept)
        if self.blocked is not None:
            self.blocked = (take_ranges(self.blocked, kept.spans, -1) if isinstance(kept, KeptRanges)
                            else self.blocked.gather(-1, kept))
        if self.eviction is not None and self.eviction.rerotate:
            self._rerotate(self.rotary.shape[-1] if rotary_end is None else rotary_end)

    def block(self, blocked: torch.Tensor | None) -> None:
        """Hold entries ``blocked`` [B, H_kv, T] without attending to them (recorded as evicted): heads of a layer
        must hold the same count, so a head that keeps fewer tokens than another pads with blocked ones."""
        if blocked is None:
            return
        self.blocked = blocked.to(self.positions.device)
        if self.owner.ledger is not None:
            self.owner.ledger.record_where(self.layer_idx, self.owner.step, self.positions[0], self.blocked[0])

    def _rerotate(self, end: int) -> None:
        """Give cached keys consecutive rotary positions ending at ``end - 1`` (StreamingLLM's position shift).

        Only distances matter to RoPE: a query at position p then sees the key i entries back at distance i, as if
        the evicted tokens had never existed.
        """
        # re-rotating methods keep the same entries in every head (see EvictionMethod): one row serves them all
        keys, _ = self.storage.materialize()
        plan = self.owner.rerotation(self.rotary[0, 0], end, keys.dtype)
        if plan is None:  # every key already sits where it should
            return
        # typically only the sinks move: rotate those few entries where they are
        self.storage.write_keys(plan.changed, self.owner.rotate_keys.apply(keys[:, :, plan.changed], plan.cos,
                                                                           plan.sin))
        self.rotary = plan.target.expand_as(self.rotary)

    def nbytes(self) -> StorageBytes:
        return self.storage.nbytes()


class KVCache(Cache):
    """The cache kvviz replays with: one :class:`KVLayer` per decoder layer, a shared step context, a ledger."""

    def __init__(
        self,
        num_layers: int,
        stack: MethodStack | None = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: KeyRotator | None = None,
    ):
        self.stack = stack or MethodStack()
        self.ledger = ledger
        self.rotate_keys = rotate_keys
        self.prompt_length = 0
        self.step = 0
        self.decoding = False
        self.step_positions = torch.zeros(0, dtype=torch.long)
        self.step_rotary = torch.zeros(0, dtype=torch.long)
        self.step_rotary_end = 0  # one past the newest token's rotary position
        self._rerotation: tuple[tuple, torch.Tensor, Rerotation | None] | None = None  # the last layer's answer
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

    def rerotation(self, rotary: torch.Tensor, end: int, dtype: torch.dtype) -> Rerotation | None:
        """How to move keys at rotary positions ``rotary`` [T] to consecutive positions ending at ``end - 1``, or
        None when none move. Layers that hold the same positions in a step (every layer, for a positional policy)
        share one answer instead of each computing the angles again."""
        last = self._rerotation
        if last is not None and last[0] == (end, dtype) and torch.equal(last[1], rotary):
            return last[2]
        target = torch.arange(end - rotary.numel(), end, device=rotary.device)
        changed = (target != rotary).nonzero().flatten()
        plan = None
        if changed.numel():
            plan = Rerotation(target, changed, *self.rotate_keys.angles(target[changed] - rotary[changed], dtype))
        self._rerotation = ((end, dtype), rotary, plan)
        return plan

    def begin_forward(self, absolute: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Set the positions of the tokens about to be fed; return (position_ids, cache_position) for the model."""
        self.step = step
        self.step_positions = absolute.cpu()
        self.step_rotary = self.next_rotary_positions(self.step_positions)
        self.step_rotary_end = int(self.step_rotary.max()) + 1
        if self.ledger is not None:
            self.ledger.ensure(int(absolute.max()) + 1)
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
        rotate_keys: KeyRotator | None = None,
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
                layer.block(layer.eviction.prefill_blocked(layer.layer_idx))
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


@dataclass
class KeyRotator:
    """Rotates cached keys by per-entry position deltas with the model's rotary frequencies (rotate-half RoPE).

    It reads ``inv_freq`` (which RoPE variants that rescale with length keep up to date) instead of calling the
    rotary module: the module's autocast guard costs more than rotating a few sink keys, once per layer and step.
    """

    inv_freq: torch.Tensor

    def angles(self, delta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., D] of the rotation by ``delta`` positions."""
        angles = delta.to(self.inv_freq.device).unsqueeze(-1).float() * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = keys.shape[-1] // 2
        return keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin


def rope_rotator(model: torch.nn.Module) -> KeyRotator | None:
    """The rotator for ``model``'s keys, or None when it has no rotary embedding to read."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    return None if inv_freq is None else KeyRotator(inv_freq)
