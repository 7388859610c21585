"""A transformers Cache whose layers apply a method stack: which entries stay (eviction) and how they are stored.

Positions: every stored entry remembers its absolute token position (for the ledger and the UI) and the rotary
position its key currently carries. The model is called with ``cache_position`` counting stored entries (so masks
line up with the compacted cache) and ``position_ids`` from :meth:`KVCache.next_rotary_positions` (absolute
positions, or in-cache positions when a method re-rotates).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvviz.cache.attention import KeyPart
from kvviz.cache.kvlayer import FirstUpdateLayer, KVLayer, StepContext
from kvviz.cache.layer_types import LayerTypes
from kvviz.cache.ledger import EvictionLedger
from kvviz.cache.protocol import Decode
from kvviz.cache.rotation import KeyRerotation, KeyRotator
from kvviz.cache.spec import MethodStack
from kvviz.cache.storage import DenseStorage, KVStorage, StorageBytes

__all__ = ["FirstUpdateLayer", "KVCache", "KVLayer", "StepContext"]


class KVCache(Cache):
    """The cache kvviz replays with: one :class:`KVLayer` per decoder layer, each forward's step context, a ledger.

    It builds its layers with what they need and hands them each forward's :class:`StepContext`; the layers never
    reach back into it. ``layer_types`` gives local layers their windows (:mod:`kvviz.cache.layer_types`); without
    it every layer holds every token, which is what a dense prefill does (it is forked, never decoded, and the
    prompt's own forward masks each local layer's window).
    """

    def __init__(
        self,
        num_layers: int,
        stack: MethodStack | None = None,
        ledger: EvictionLedger | None = None,
        rotate_keys: KeyRotator | None = None,
        protected: torch.Tensor | None = None,
        layer_types: LayerTypes | None = None,
    ):
        """``protected``: absolute positions no eviction may drop (:mod:`kvviz.cache.protect`), or None."""
        self.stack = stack or MethodStack()
        self._ledger = ledger
        self.rotate_keys = rotate_keys
        self.layer_types = layer_types or LayerTypes.uniform(num_layers)
        self.prompt_length = 0
        self.decoding = False
        self.context = StepContext()
        rerotation = KeyRerotation(rotate_keys)
        layers = [KVLayer(i, num_layers, self.new_storage(i), self.stack.eviction, ledger, protected, rerotation,
                          partial(self.new_storage, i), self.layer_types.windows[i]) for i in range(num_layers)]
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

        Re-rotated positions stay consecutive (see :meth:`KVLayer.rerotate_to`) but are not reset to zero each step:
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
        stored = self.get_seq_length()
        self.begin_step(StepContext(step, self.prompt_length, absolute, rotary, evicting=self.decoding,
                                    cache_start=stored))
        if self.ledger is not None:
            self.ledger.ensure(int(absolute.max()) + 1)
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
        return self.decoding and self.selects_after_attention and self.layers[layer_idx].evicts

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
        layer_types: LayerTypes | None = None,
    ) -> KVCache:
        """A new cache holding ``prefill``'s entries under ``stack``: stored its way, compressed by its eviction,
        each local layer (``layer_types``) holding only its window.

        ``prefill`` is a dense cache after the prompt's forward; it is not modified, so many methods can fork it.
        ``protected``: absolute positions the eviction may never drop (see :mod:`kvviz.cache.protect`).
        """
        cache = cls(len(prefill.layers), stack, ledger, rotate_keys, protected, layer_types)
        cache.prompt_length = prefill.prompt_length
        for source, layer in zip(prefill.layers, cache.layers, strict=True):
            keys, values = source.storage.materialize()
            # step 0, the prompt's own positions: an architecture storage's appends read their rotary positions
            cache.begin_step(StepContext(0, cache.prompt_length, rotary=source.rotary[0, 0].cpu()))
            if stack.architecture is not None:  # projections from the prompt's own K/V
                layer.storage.calibrate(keys, values, cache.step_rotary)
            layer.hold_prompt(keys, values, source.positions, source.rotary, stats, rotate=False)
        if cache.rerotates:  # one end for every layer: the next query's rotary position is the same in all of them
            end = max(len(layer.storage) for layer in cache.layers)
            for layer in cache.layers:
                layer.rerotate_to(end)
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
