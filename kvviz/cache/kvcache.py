"""A transformers Cache whose layers apply a method stack: which entries stay (eviction) and how they are stored.

Positions: every stored entry remembers its absolute token position (for the ledger and the UI) and the rotary
position its key currently carries. The model is called with ``cache_position`` counting stored entries (so masks
line up with the compacted cache) and ``position_ids`` from :meth:`KVCache.next_rotary_positions` (absolute
positions, or in-cache positions when a method re-rotates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvviz.cache.attention import KeyPart
from kvviz.cache.ledger import EvictionLedger
from kvviz.cache.protect import with_protected
from kvviz.cache.protocol import Decode, EvictionMethod, LayerView
from kvviz.cache.rotation import KeyRerotation, KeyRotator
from kvviz.cache.spec import MethodStack, SpecError
from kvviz.cache.storage import DenseStorage, Keep, KVStorage, StorageBytes, as_keep


@dataclass
class StepContext:
    """What a cache tells its layers about the forward under way (:meth:`KVLayer.begin_step`): one object for every
    layer, which copies the new tokens' positions to a device once for all of them (a copy per layer made each GPU
    decode step wait on the host 2 x layers times).

    step: 0 for the prompt (its forward and its compression), s >= 1 for the s-th token fed after it.
    absolute, rotary: [new] absolute positions of the tokens fed and the rotary positions their keys carry (CPU).
    evicting: the method may evict as tokens arrive (a forked cache decoding; not the dense prefill).
    """

    step: int = 0
    prompt_length: int = 0
    absolute: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    rotary: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    evicting: bool = False
    rotary_end: int = field(init=False)  # one past the newest token's rotary position
    _on_device: tuple[torch.device, torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rotary_end = int(self.rotary.max()) + 1 if self.rotary.numel() else 0

    def positions_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' absolute and rotary positions on ``device``."""
        if self._on_device is None or self._on_device[0] != device:
            self._on_device = (device, self.absolute.to(device), self.rotary.to(device))
        return self._on_device[1], self._on_device[2]


class FirstUpdateLayer(CacheLayerMixin):
    """A transformers cache layer that learns its dtype and device from the first keys it is given."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True


class KVLayer(FirstUpdateLayer):
    """One layer's cache: a storage, the positions of its entries, and the eviction method's state.

    It is given what it works with when built (its index of ``layer_count``, the method, the ledger it records
    into, the absolute positions no eviction may drop, the shared key re-rotation, a maker of empty storages in the
    stack's format) and each forward's step and positions in :meth:`begin_step`: it reads nothing from the cache
    that holds it, so one layer can be built and tested alone.
    """

    is_sliding = False

    def __init__(self, layer_idx: int, layer_count: int, storage: KVStorage, eviction: EvictionMethod | None = None,
                 ledger: EvictionLedger | None = None, protected: torch.Tensor | None = None,
                 rerotation: KeyRerotation | None = None, new_storage: Callable[[], KVStorage] = DenseStorage):
        super().__init__()
        self.layer_idx, self.layer_count = layer_idx, layer_count
        self.storage = storage
        self.eviction = eviction
        self.decode = eviction.schedule.decode if eviction is not None else Decode.NEVER  # when it selects
        self.ledger = ledger
        self.protected = protected  # absolute positions no eviction may drop (kvviz.cache.protect), or None
        self.rerotation = rerotation
        self.new_storage = new_storage
        self.context = StepContext()
        self.state = eviction.new_state(layer_idx) if eviction is not None else None
        self.positions: torch.Tensor | None = None  # [B, H_kv, T] absolute positions
        self.rotary: torch.Tensor | None = None  # [B, H_kv, T] positions the keys are rotated to
        self.padding: torch.Tensor | None = None  # [B, H_kv, T] True on padding slots once heads keep unequal counts
        self.blocked: torch.Tensor | None = None  # [B, H_kv, T] entries held but never attended (see block)

    def begin_step(self, context: StepContext) -> None:
        """The forward about to run: its step, the prompt's length and the positions of the tokens it feeds."""
        self.context = context

    # -- transformers' layer protocol -------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        context = self.context
        batch, heads, new = key_states.shape[:3]
        heads = self.storage.cache_heads(heads)
        absolute, rotary = (t.view(1, 1, new).expand(batch, heads, new)
                            for t in context.positions_on(key_states.device))
        self.storage.append(key_states, value_states)
        self.positions = absolute.clone() if self.positions is None else torch.cat([self.positions, absolute], -1)
        self.rotary = rotary.clone() if self.rotary is None else torch.cat([self.rotary, rotary], -1)
        if self.padding is not None:
            self.padding = torch.cat([self.padding, torch.zeros_like(absolute, dtype=torch.bool)], -1)
        if context.evicting and self.decode is Decode.AFTER_APPEND:
            # the new tokens' queries already carry rotary positions; re-rotated keys must end where they stand
            self.apply_keep(self.eviction.select(self.view()), rotary_end=context.rotary_end)
        if self.blocked is not None:
            self.blocked = torch.cat([self.blocked, self.blocked.new_zeros(batch, heads, new)], -1)
        return self.storage.materialize()

    @property
    def hidden(self) -> torch.Tensor | None:
        """[B, H_kv, T] True on the slots attention skips (padding and blocked entries), or None when none are."""
        if self.blocked is None:
            return self.padding
        return self.blocked if self.padding is None else self.padding | self.blocked

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
            layers=self.layer_count,
            positions=self.positions,
            entries=self.storage.materialize,
            prompt_length=self.context.prompt_length,
            step=self.context.step,
            attention=attention,
            state=self.state,
        )

    def hold_prompt(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rotary: torch.Tensor,
                    stats: Any = None) -> None:
        """Hold a dense prefill's entries (K/V [B, H, T, D], absolute and rotary positions [B, H, T]) and compress
        them as the method decides after the prompt (:meth:`EvictionMethod.prefill_select`, reading ``stats``)."""
        self.lazy_initialization(keys, values)
        self.storage.append(keys, values)
        heads = self.storage.cache_heads(keys.shape[1])  # every head of a dense prefill holds the same tokens
        self.positions, self.rotary = positions[:, :heads].clone(), rotary[:, :heads].clone()
        if self.eviction is not None:
            self.apply_keep(self.eviction.prefill_select(self.view(), stats))
            self.block(self.eviction.prefill_blocked(self.layer_idx))

    def select_by_attention(self, probs: torch.Tensor) -> None:
        """After this layer's attention, for a method that selects by it (``Decode.AFTER_ATTENTION``): keep what it
        chooses from the new queries' probabilities ``probs`` [B, H_q, q, T]."""
        self.apply_keep(self.eviction.select(self.view(attention=probs)))

    def apply_keep(self, kept: torch.Tensor | Keep | None, rotary_end: int | None = None) -> None:
        """Keep entries ``kept`` (as a method chose them: an index [B, H, n] or a keep of :mod:`kvviz.cache.storage`);
        record the rest in the ledger; re-rotate keys if the method asks. Each kind of keep applies itself.

        ``rotary_end``: one past the rotary position re-rotated keys must end at (the in-flight queries' position);
        by default the cache length, so the next token (given rotary position ``len(cache)``) follows on.
        """
        keep = None if kept is None else as_keep(kept)
        if keep is not None and self.protected is not None:
            keep = self._protected(keep)
        if keep is None:
            return
        if self.ledger is not None:
            keep.record(self.ledger, self.layer_idx, self.context.step, self.positions)
        self.storage = keep.keep_in(self.storage, self.new_storage)
        self.padding = keep.padding_after(self.padding)
        self.positions, self.rotary = keep.take(self.positions), keep.take(self.rotary)
        self.blocked = None if self.blocked is None else keep.take(self.blocked)
        if self.eviction is not None and self.eviction.rerotate:
            self._rerotate(self.rotary.shape[-1] if rotary_end is None else rotary_end)

    def _protected(self, keep: Keep) -> Keep | None:
        """``keep`` widened so that no protected position is dropped (:mod:`kvviz.cache.protect`)."""
        if not keep.protectable:  # said, not silently ignored
            raise SpecError(f"{self.eviction.name} cannot protect spans: its heads keep different counts or "
                            "merge entries; protect with a method that drops whole entries")
        widened = with_protected(keep, self.positions, self.protected)
        return None if widened is None else as_keep(widened)

    def block(self, blocked: torch.Tensor | None) -> None:
        """Hold entries ``blocked`` [B, H_kv, T] without attending to them (recorded as evicted): heads of a layer
        must hold the same count, so a head that keeps fewer tokens than another pads with blocked ones."""
        if blocked is None:
            return
        self.blocked = blocked.to(self.positions.device)
        if self.ledger is not None:
            self.ledger.record_per_head(self.layer_idx, self.context.step, self.positions[0], self.blocked[0])

    def _rerotate(self, end: int) -> None:
        """Give cached keys consecutive rotary positions ending at ``end - 1`` (StreamingLLM's position shift).

        Only distances matter to RoPE: a query at position p then sees the key i entries back at distance i, as if
        the evicted tokens had never existed.
        """
        if self.rerotation is None:
            raise SpecError(f"{self.eviction.name} re-rotates cached keys: give the layer a KeyRerotation")
        # re-rotating methods keep the same entries in every head (see EvictionMethod): one row serves them all
        keys, _ = self.storage.materialize()
        plan = self.rerotation.plan(self.rotary[0, 0], end, keys.dtype)
        if plan is None:  # every key already sits where it should
            return
        # typically only the sinks move: rotate those few entries where they are
        self.storage.write_keys(plan.changed, self.rerotation.moved_keys(keys, plan))
        self.rotary = plan.target.expand_as(self.rotary)

    def nbytes(self) -> StorageBytes:
        """What the storage holds. With unequal counts per head in a storage whose entries each cost the same (dense,
        fp8, bnb), only the valid entries' share plus one int32 length per head, as a varlen layout holds them;
        group quantizers hold the padding rows inside their groups, so their padded layout is counted as it is."""
        held = self.storage.nbytes()
        if self.padding is None or not self.storage.per_entry_bytes:
            return held
        slots = self.padding.numel()
        valid = slots - int(self.padding.sum())
        lengths = 4 * self.padding.shape[0] * self.padding.shape[1]
        return StorageBytes(codes=held.codes * valid // slots, metadata=held.metadata + lengths,
                            full_precision=held.full_precision * valid // slots)


class KVCache(Cache):
    """The cache kvviz replays with: one :class:`KVLayer` per decoder layer, each forward's step context, a ledger.

    It builds its layers with what they need and hands them each forward's :class:`StepContext`; the layers never
    reach back into it.
    """

    def __init__(
        self,
        num_layers: int,
        stack: MethodStack | None = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: KeyRotator | None = None,
        protected: torch.Tensor | None = None,
    ):
        """``protected``: absolute positions no eviction may drop (:mod:`kvviz.cache.protect`), or None."""
        self.stack = stack or MethodStack()
        self._ledger = ledger
        self.rotate_keys = rotate_keys
        self.prompt_length = 0
        self.decoding = False
        self.context = StepContext()
        rerotation = KeyRerotation(rotate_keys)
        layers = [KVLayer(i, num_layers, self.new_storage(i), self.stack.eviction, ledger, protected, rerotation,
                          partial(self.new_storage, i)) for i in range(num_layers)]
        super().__init__(layers=layers)

    @property
    def ledger(self) -> EvictionLedger | None:
        return self._ledger

    @ledger.setter
    def ledger(self, ledger: EvictionLedger | None) -> None:
        """The layers record into it: a new one (a teacher-forced twin drops its own) reaches them all."""
        self._ledger = ledger
        for layer in self.layers:
            layer.ledger = ledger

    def new_storage(self, layer_idx: int) -> KVStorage:
        """An empty storage for one layer in the stack's format: dense or quantized, wrapped by the architecture
        method when there is one (it keeps its compressed form in that storage)."""
        quantization, architecture = self.stack.quantization, self.stack.architecture
        storage = quantization.new_storage(layer_idx) if quantization else DenseStorage()
        return storage if architecture is None else architecture.wrap_storage(layer_idx, storage, self)

    @property
    def rerotates(self) -> bool:
        return self.stack.eviction is not None and self.stack.eviction.rerotate

    @property
    def selects_after_attention(self) -> bool:
        """Whether the method selects by each decode step's attention (``Decode.AFTER_ATTENTION``): a decode through
        this cache must then listen to attention (:meth:`observe`)."""
        return self.stack.eviction is not None and self.stack.eviction.schedule.decode is Decode.AFTER_ATTENTION

    @property
    def step_rotary(self) -> torch.Tensor:
        """The rotary positions of the tokens being fed [new] (an architecture storage compresses keys before RoPE)."""
        return self.context.rotary

    def next_rotary_positions(self, absolute: torch.Tensor) -> torch.Tensor:
        """Rotary positions for new tokens: absolute, or right after the cache's last key when keys are re-rotated.

        Re-rotated positions stay consecutive (see :meth:`KVLayer._rerotate`) but are not reset to zero each step:
        RoPE only sees distances, so sliding them forward costs nothing and keeps in-flight queries valid.
        """
        if self.rerotates and self.layers[0].rotary is not None:
            return torch.arange(absolute.numel()) + int(self.layers[0].rotary.max()) + 1
        return absolute

    def begin_step(self, context: StepContext) -> None:
        """Tell every layer about the forward under way."""
        self.context = context
        for layer in self.layers:
            layer.begin_step(context)

    def begin_forward(self, absolute: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Set the positions of the tokens about to be fed; return (position_ids, cache_position) for the model."""
        absolute = absolute.cpu()
        rotary = self.next_rotary_positions(absolute)
        self.begin_step(StepContext(step, self.prompt_length, absolute, rotary, evicting=self.decoding))
        if self.ledger is not None:
            self.ledger.ensure(int(absolute.max()) + 1)
        stored = self.get_seq_length()
        cache_position = torch.arange(stored, stored + absolute.numel())
        return rotary.unsqueeze(0), cache_position

    # -- what attention reads: passed with the model call as ``key_source`` (kvviz.cache.attention.KeySource) -------
    def key_parts(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> list[KeyPart]:
        """The whole batch over the keys just returned by this layer's update, skipping its hidden slots; the
        cache listens to its own attention when its method scores at decode time."""
        return [KeyPart(slice(None), keys, values, self.layers[layer_idx].hidden,
                        self if self.wants(layer_idx) else None)]

    def forward_inputs(self) -> dict[str, Any]:
        """The keywords a model call through this cache adds: the cache itself as its attention's key source."""
        return {"past_key_values": self, "key_source": self}

    # -- attention listener: methods that score entries by the current query's attention -------------------------
    def wants(self, layer_idx: int) -> bool:
        return self.decoding and self.selects_after_attention

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None:
        self.layers[layer_idx].select_by_attention(probs)

    # -- prefill and forking ----------------------------------------------------------------------------------
    @classmethod
    def fork(
        cls,
        prefill: KVCache,
        stack: MethodStack,
        stats: Any = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: KeyRotator | None = None,
        protected: torch.Tensor | None = None,
    ) -> KVCache:
        """A new cache holding ``prefill``'s entries under ``stack``: stored its way, compressed by its eviction.

        ``prefill`` is a dense cache after the prompt's forward; it is not modified, so many methods can fork it.
        ``protected``: absolute positions the eviction may never drop (see :mod:`kvviz.cache.protect`).
        """
        cache = cls(len(prefill.layers), stack, ledger, rotate_keys, protected)
        cache.prompt_length = prefill.prompt_length
        for source, layer in zip(prefill.layers, cache.layers, strict=True):
            keys, values = source.storage.materialize()
            # step 0, the prompt's own positions: an architecture storage's appends read their rotary positions
            cache.begin_step(StepContext(0, cache.prompt_length, rotary=source.rotary[0, 0].cpu()))
            if stack.architecture is not None:  # projections from the prompt's own K/V
                layer.storage.calibrate(keys, values, cache.step_rotary)
            layer.hold_prompt(keys, values, source.positions, source.rotary, stats)
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
        """[H_kv, T] absolute positions cached in a layer right now (batch 0); with unequal counts per head, the
        padding slots repeat the head's last kept position."""
        return self.layers[layer_idx].positions[0]
