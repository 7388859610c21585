"""One layer of kvviz's cache: a storage, the positions of its entries, its method's state, its window.

Positions: every stored entry remembers its absolute token position (for the ledger and the UI) and the rotary
position its key currently carries. :class:`StepContext` is what the cache tells every layer about the forward
under way; a layer reads nothing else from the cache that holds it, so one layer can be built and tested alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvviz.cache.ledger import EvictionLedger
from kvviz.cache.protect import with_protected
from kvviz.cache.protocol import Decode, EvictionMethod, LayerView, OnLocal
from kvviz.cache.rotation import KeyRerotation
from kvviz.cache.spec import SpecError
from kvviz.cache.storage import DenseStorage, Keep, KeptRanges, KVStorage, RaggedKeep, StorageBytes, as_keep


@dataclass
class StepContext:
    """What a cache tells its layers about the forward under way (:meth:`KVLayer.begin_step`): one object for every
    layer, which copies the new tokens' positions to a device once for all of them (a copy per layer made each GPU
    decode step wait on the host 2 x layers times).

    step: 0 for the prompt (its forward and its compression), s >= 1 for the s-th token fed after it.
    absolute, rotary: [new] absolute positions of the tokens fed and the rotary positions their keys carry (CPU).
    evicting: the method may evict as tokens arrive (a forked cache decoding; not the dense prefill).
    cache_start: the ``cache_position`` of the first token fed (the first layer's entry count), known on the host so
    that sizing a mask never reads a device tensor back.
    """

    step: int = 0
    prompt_length: int = 0
    absolute: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    rotary: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    evicting: bool = False
    cache_start: int = 0
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
    stack's format, its sliding window when it is a local layer) and each forward's step and positions in
    :meth:`begin_step`: it reads nothing from the cache that holds it, so one layer can be built and tested alone.

    A local layer (``window`` set, :mod:`kvviz.cache.layer_types`) holds what the model's own sliding layer holds:
    after each forward, the ``window - 1`` newest tokens, the rest of the next query's window. What slides out is
    recorded in the ledger at the step it left, as an eviction no method chose. The method runs on it only when it
    says so (:class:`~kvviz.cache.protocol.OnLocal`). Its entries stay consecutive (the window, or a narrower recent
    window), so a mask that measures the window in cache indices measures it in tokens (:meth:`get_mask_sizes`).
    """

    def __init__(self, layer_idx: int, layer_count: int, storage: KVStorage, eviction: EvictionMethod | None = None,
                 ledger: EvictionLedger | None = None, protected: torch.Tensor | None = None,
                 rerotation: KeyRerotation | None = None, new_storage: Callable[[], KVStorage] = DenseStorage,
                 window: int | None = None):
        super().__init__()
        self.layer_idx, self.layer_count = layer_idx, layer_count
        self.storage = storage
        self.window = window
        self.eviction = eviction
        # the method runs here: on every global layer, and on a local one when it selects within windows
        self.evicts = eviction is not None and (window is None or eviction.on_local_layers is OnLocal.WITHIN_WINDOW)
        self.decode = eviction.schedule.decode if self.evicts else Decode.NEVER  # when it selects
        self.ledger = ledger
        self.protected = protected  # absolute positions no eviction may drop (kvviz.cache.protect), or None
        self.rerotation = rerotation
        self.new_storage = new_storage
        self.context = StepContext()
        self.state = eviction.new_state(layer_idx) if self.evicts else None
        self.positions: torch.Tensor | None = None  # [B, H_kv, T] absolute positions
        self.rotary: torch.Tensor | None = None  # [B, H_kv, T] positions the keys are rotated to
        self.padding: torch.Tensor | None = None  # [B, H_kv, T] True on padding slots once heads keep unequal counts
        self.blocked: torch.Tensor | None = None  # [B, H_kv, T] entries held but never attended (see block)
        # a local layer's oldest position while its entries are consecutive (every head alike), known on the host so
        # that sliding the window reads nothing back from the device; None once a method's choice made it unknown
        self.oldest: int | None = None

    @property
    def is_sliding(self) -> bool:
        """A local layer (transformers' name: ``DynamicSlidingWindowLayer.is_sliding``)."""
        return self.window is not None

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
        if self.window is not None:  # what no new query sees (a cache built by hand; a chunk of several tokens)
            self.slide(int(context.absolute[0]) - self.window + 1)
            if not len(self.storage):
                self.oldest = int(context.absolute[0])
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
        keys, values = self.storage.materialize()
        if self.window is not None:  # attention reads what it was just given; the next token's window starts later
            self.slide(int(context.absolute[-1]) - self.window + 2)
        return keys, values

    @property
    def hidden(self) -> torch.Tensor | None:
        """[B, H_kv, T] True on the slots attention skips (padding and blocked entries), or None when none are."""
        if self.blocked is None:
            return self.padding
        return self.blocked if self.padding is None else self.padding | self.blocked

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """The keys attention reads (held plus new) and the index of the first: the held entries end right before
        the queries' ``cache_position``, whichever layer that count came from (a local layer holds fewer entries
        than a global one), so a window measured in indices is measured in tokens."""
        held = len(self.storage)
        return held + cache_position.shape[0], self.context.cache_start - held

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
                    stats: Any = None, rotate: bool = True) -> None:
        """Hold a dense prefill's entries (K/V [B, H, T, D], absolute and rotary positions [B, H, T]) and compress
        them as the method decides after the prompt (:meth:`EvictionMethod.prefill_select`, reading ``stats``).
        ``rotate=False``: a re-rotating method's keys stay where they are (the fork moves every layer to one end)."""
        self.lazy_initialization(keys, values)
        self.storage.append(keys, values)
        heads = self.storage.cache_heads(keys.shape[1])  # every head of a dense prefill holds the same tokens
        self.positions, self.rotary = positions[:, :heads].clone(), rotary[:, :heads].clone()
        if self.window is not None:  # the model's own local layer holds the window of the next token
            first, last = int(positions[0, 0, 0]), int(positions[0, 0, -1])  # once, at the fork
            self.oldest = first if last - first + 1 == positions.shape[-1] else None  # a dense prefill: consecutive
            self.slide(last - self.window + 2)
        if self.evicts:
            self.apply_keep(self.eviction.prefill_select(self.view(), stats), rotate=rotate)
            self.block(self.eviction.prefill_blocked(self.layer_idx))

    def select_by_attention(self, probs: torch.Tensor) -> None:
        """After this layer's attention, for a method that selects by it (``Decode.AFTER_ATTENTION``): keep what it
        chooses from the new queries' probabilities ``probs`` [B, H_q, q, T]."""
        self.apply_keep(self.eviction.select(self.view(attention=probs)))

    def apply_keep(self, kept: torch.Tensor | Keep | None, rotary_end: int | None = None,
                   rotate: bool = True) -> None:
        """Keep entries ``kept`` (as a method chose them: an index [B, H, n] or a keep of :mod:`kvviz.cache.storage`);
        record the rest in the ledger; re-rotate keys if the method asks. Each kind of keep applies itself.

        ``rotary_end``: one past the rotary position re-rotated keys must end at (the in-flight queries' position);
        by default the cache length, so the next token (given rotary position ``len(cache)``) follows on.
        ``rotate=False``: leave the re-rotation to the caller (a fork re-rotates every layer to one end).
        """
        keep = None if kept is None else as_keep(kept)
        if keep is not None and self.protected is not None:
            keep = self._protected(keep)
        if keep is None:
            return
        self._keep(keep)
        self.oldest = None  # what a method kept need not be consecutive any more
        if rotate and self.eviction is not None and self.eviction.rerotate:
            self.rerotate_to(self.rotary.shape[-1] if rotary_end is None else rotary_end)

    def _keep(self, keep: Keep, record: bool = True) -> None:
        """Hold only what ``keep`` keeps (entries, positions, padding, blocked slots); the rest goes in the ledger
        (unless the caller recorded it: ``record=False``)."""
        if record and self.ledger is not None:
            keep.record(self.ledger, self.layer_idx, self.context.step, self.positions)
        self.storage = keep.keep_in(self.storage, self.new_storage)
        self.padding = keep.padding_after(self.padding)
        self.positions, self.rotary = keep.take(self.positions), keep.take(self.rotary)
        self.blocked = None if self.blocked is None else keep.take(self.blocked)

    def slide(self, first: int) -> None:
        """A local layer's window moved on: drop the entries before absolute position ``first``, which the model's
        own attention never reads again. Protected spans cannot hold them (the model would not see them either)."""
        positions = self.positions
        if positions is None or not positions.shape[-1]:
            return
        batch, heads, length = positions.shape
        record = True
        if self.oldest is not None and first - self.oldest < length:  # consecutive: decided on the host
            dropped = first - self.oldest
            if dropped <= 0:
                return
            keep = KeptRanges(((dropped, length),), batch, heads, positions.device)
            if self.ledger is not None:
                gone = torch.arange(self.oldest, first).expand(heads, dropped)
                self.ledger.record(self.layer_idx, self.context.step, gone)
            record, self.oldest = False, first
        else:
            if int(positions[..., 0].min()) >= first:
                return
            visible = positions >= first  # entries sit in ascending position per head: the visible ones are the tail
            counts = visible.sum(-1)
            if bool((counts == counts.flatten()[0]).all()):
                keep = KeptRanges(((length - int(counts.flatten()[0]), length),), batch, heads, positions.device)
            else:
                keep = RaggedKeep.from_mask(visible)
        try:
            self._keep(keep, record)
        except SpecError as error:  # a storage that cannot drop entries (transformers' quantized layer)
            raise SpecError(f"layer {self.layer_idx} is local (window {self.window}) and drops what leaves its "
                            f"window: {error}") from None

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

    def rerotate_to(self, end: int) -> None:
        """Give cached keys consecutive rotary positions ending at ``end - 1`` (StreamingLLM's position shift).

        Only distances matter to RoPE: a query at position p then sees the key i entries back at distance i, as if
        the evicted tokens had never existed. Every layer of a cache ends at the same position (the next query's
        rotary position is one for all layers); a local layer's window, consecutive, just shifts.
        """
        if self.rerotation is None:
            raise SpecError(f"{self.eviction.name} re-rotates cached keys: give the layer a KeyRerotation")
        # re-rotating methods keep the same entries in every head (see EvictionMethod): one row serves them all
        keys, _ = self.storage.materialize()
        plan = self.rerotation.plan(self.rotary[0, 0], end, keys.dtype, self.layer_idx)
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
