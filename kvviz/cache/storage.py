"""How a layer's K/V entries are held in memory. Dense tensors here; quantized stores live with their methods
(those quantizing each token on arrival build on :mod:`kvviz.cache.quantized`).

A storage holds entries in cache order, per KV head: keys and values ``[B, H_kv, T, D]``. Eviction keeps a subset
(``keep``), decoding appends, attention reads ``materialize()``. ``nbytes`` counts exactly the tensors held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvviz.cache.ledger import EvictionLedger


@dataclass
class StorageBytes:
    """Bytes a storage holds, split the way the memory bars show it."""

    codes: int = 0  # packed quantized codes
    metadata: int = 0  # scales, zero points and other quantization bookkeeping
    full_precision: int = 0  # entries kept in the model's dtype (a dense cache, or a quantizer's residual)

    @property
    def total(self) -> int:
        return self.codes + self.metadata + self.full_precision

    def __add__(self, other: StorageBytes) -> StorageBytes:
        return StorageBytes(
            self.codes + other.codes, self.metadata + other.metadata, self.full_precision + other.full_precision
        )


GROWTH_TOKENS = 64  # room a dense storage leaves after its entries when it copies them (at least; see DenseStorage)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gather_tokens(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Select entries along the token axis (dim 2) per head: ``tensor`` [B, H, T, ...], ``index`` [B, H, n].

    Done as one row copy over a flattened [B*H*T, rest] view: several times faster than ``gather`` with an index
    expanded over the head dimension, which is what keeps eviction cheap on every decode step.
    """
    batch, heads, length = tensor.shape[:3]
    rest = tensor.shape[3:]
    offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * length
    rows = (index.to(offsets.device) + offsets).reshape(-1)
    picked = tensor.reshape(batch * heads * length, -1).index_select(0, rows.to(tensor.device))
    return picked.view(batch, heads, index.shape[-1], *rest)


def take_ranges(tensor: torch.Tensor, spans: tuple[tuple[int, int], ...], dim: int) -> torch.Tensor:
    """The entries of ``tensor`` along ``dim`` within ``spans``, in one copy."""
    return torch.cat([tensor.narrow(dim, start, end - start) for start, end in spans], dim=dim)


# What an eviction keeps comes in four kinds. Each applies itself (KVLayer.apply_keep runs the same steps for all):
# ``take`` keeps its entries of a per-entry tensor [B, H, T], ``record`` writes what it dropped into a ledger,
# ``keep_in`` shrinks a storage (or stores merged entries afresh) and ``padding_after`` says which slots are padding.


@dataclass(frozen=True)
class KeptRanges:
    """Entries every head keeps, as ascending cache-index ranges ``[start, end)``: what positional policies (a
    window, sinks + window) choose. Slicing ranges is a plain copy with no index to build, so eviction stays cheap."""

    spans: tuple[tuple[int, int], ...]
    batch: int
    heads: int
    device: torch.device | str = "cpu"

    protectable: ClassVar[bool] = True  # protected spans can widen it (kvviz.cache.protect)

    def index(self) -> torch.Tensor:
        """The same choice as an index [B, H, n], for storages and code that gather."""
        kept = torch.cat([torch.arange(start, end, device=self.device) for start, end in self.spans])
        return kept.expand(self.batch, self.heads, kept.numel())

    def dropped(self, length: int) -> tuple[tuple[int, int], ...]:
        """The ranges of the ``length`` entries that are not kept."""
        gaps, cursor = [], 0
        for start, end in self.spans:
            if start > cursor:
                gaps.append((cursor, start))
            cursor = end
        if cursor < length:
            gaps.append((cursor, length))
        return tuple(gaps)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return take_ranges(tensor, self.spans, -1)

    def record(self, ledger: EvictionLedger, layer_idx: int, step: int, positions: torch.Tensor) -> None:
        gaps = self.dropped(positions.shape[-1])
        if gaps:
            ledger.record(layer_idx, step, take_ranges(positions[0], gaps, -1))

    def keep_in(self, storage: KVStorage, new_storage: Callable[[], KVStorage]) -> KVStorage:
        storage.keep_ranges(self)
        return storage

    def padding_after(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        return None if padding is None else self.take(padding)


@dataclass(frozen=True)
class KeptIndex:
    """Entries kept per head, ``index`` [B, H, n] ascending: what scoring methods choose (they return the bare
    tensor; :func:`as_keep` wraps it)."""

    index: torch.Tensor

    protectable: ClassVar[bool] = True

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.gather(-1, self.index)

    def removed(self, positions: torch.Tensor) -> torch.Tensor:
        """[H, T] True on batch 0's entries this keep drops."""
        return torch.ones_like(positions[0], dtype=torch.bool).scatter_(-1, self.index[0], False)

    def record(self, ledger: EvictionLedger, layer_idx: int, step: int, positions: torch.Tensor) -> None:
        ledger.record(layer_idx, step, positions[0][self.removed(positions)].view(positions.shape[1], -1))

    def keep_in(self, storage: KVStorage, new_storage: Callable[[], KVStorage]) -> KVStorage:
        storage.keep(self.index)
        return storage

    def padding_after(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        return None if padding is None else self.take(padding)


@dataclass(frozen=True)
class RaggedKeep(KeptIndex):
    """Entries kept when heads keep different numbers (head-adaptive budgets such as AdaKV).

    ``index`` [B, H, n_max] holds each head's kept entries in ascending order, padded at the end by repeating the
    head's last kept entry; ``valid`` [B, H, n_max] is False on that padding. Storages keep the padded layout (one
    tensor per layer, as attention wants); the cache masks the padding out of attention and counts only valid
    entries as held, which is what a varlen layout (AdaKV's flattened heads) stores.
    """

    valid: torch.Tensor

    protectable: ClassVar[bool] = False  # heads keep different counts: a protected span cannot be added to each

    @classmethod
    def from_mask(cls, keep: torch.Tensor) -> RaggedKeep:
        """From a bool mask [B, H, T] of entries to keep (at least one per head)."""
        length = keep.shape[-1]
        order = torch.arange(length, device=keep.device).expand_as(keep)
        ranked = torch.where(keep, order, order + length).sort(dim=-1).values  # kept first, ascending
        width = int(keep.sum(-1).max())
        counts = keep.sum(-1, keepdim=True)
        slots = torch.arange(width, device=keep.device).expand(*keep.shape[:2], width)
        valid = slots < counts
        last = ranked.gather(-1, (counts - 1).clamp_min(0))
        return cls(torch.where(valid, ranked[..., :width], last), valid)

    def record(self, ledger: EvictionLedger, layer_idx: int, step: int, positions: torch.Tensor) -> None:
        ledger.record_per_head(layer_idx, step, positions[0], self.removed(positions))

    def padding_after(self, padding: torch.Tensor | None) -> torch.Tensor | None:
        """The padded layout's padding slots (and any the kept entries already were), or None when there are none."""
        after = ~self.valid if padding is None else padding.gather(-1, self.index) | ~self.valid
        return after if bool(after.any()) else None


@dataclass(frozen=True)
class MergedKeep(KeptIndex):
    """Entries kept with new contents (merging methods): ``index`` [B, H, n] ascending as for a plain keep, and the
    kept entries' merged ``keys`` and ``values`` [B, H, n, D], which the cache stores afresh in its storage's format."""

    keys: torch.Tensor
    values: torch.Tensor

    protectable: ClassVar[bool] = False  # a merged entry holds dropped tokens too

    def keep_in(self, storage: KVStorage, new_storage: Callable[[], KVStorage]) -> KVStorage:
        stored = new_storage()
        stored.append(self.keys, self.values)
        return stored


Keep = KeptRanges | KeptIndex  # RaggedKeep and MergedKeep are KeptIndex kinds


def as_keep(kept: torch.Tensor | Keep) -> Keep:
    """A method's choice as a keep: the bare index tensor scoring methods return becomes a :class:`KeptIndex`."""
    return KeptIndex(kept) if isinstance(kept, torch.Tensor) else kept


class KVStorage:
    """Protocol every storage follows.

    ``per_entry_bytes``: every entry costs the same bytes (no groups shared between entries), so the share of a
    padded layout that is padding can be discounted exactly (see :class:`RaggedKeep`).
    """

    per_entry_bytes = False

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def keep(self, index: torch.Tensor) -> None:
        """Keep only entries ``index`` [B, H, n] (ascending), dropping the rest."""
        raise NotImplementedError

    def keep_ranges(self, kept: KeptRanges) -> None:
        """Keep only the entries in ``kept``'s ranges (storages that can slice do it without an index)."""
        self.keep(kept.index())

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as attention reads them (dequantized where stored in fewer bits)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def nbytes(self) -> StorageBytes:
        raise NotImplementedError

    def cache_heads(self, model_heads: int) -> int:
        """Heads held per layer for a model with ``model_heads`` KV heads (fewer under an architecture method)."""
        return model_heads


class DenseStorage(KVStorage):
    """Entries kept as they come, in the model's dtype: the ``full`` cache.

    Appends wait in ``pending`` until something reads the entries, so a positional eviction that follows an append
    (a sliding window dropping its oldest token) builds the kept cache in one copy, not a concatenation plus a gather.
    Once the storage has copied its entries it holds them in buffers with room for more, and appends write there in
    place: a ``full`` cache decoding does not copy its whole length every step. A window sliding over those buffers
    does not copy them either: dropping the oldest entries after the sinks moves only the sinks forward, and the
    held entries start further in (see :meth:`_slide`). ``keys`` and ``values`` are views of the held entries, so
    ``nbytes`` counts those, not the room.
    """

    per_entry_bytes = True

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.owned = False  # True once ``keys`` is a tensor this storage made (safe to write in place)
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None  # buffers ``keys``/``values`` are a slice of
        self._start = 0  # where in ``_room`` the held entries start

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = keys, values
            return
        length, new = self.keys.shape[2], keys.shape[2]
        end = self._start + length
        if self._room is not None and not self.pending and end + new <= self._room[0].shape[2]:
            room_keys, room_values = self._room  # decoding into a buffer with room: no copy of what is held
            room_keys[:, :, end:end + new].copy_(keys)
            room_values[:, :, end:end + new].copy_(values)
            self._hold(self._start, end + new)
        else:
            self.pending.append((keys, values))

    def keep(self, index: torch.Tensor) -> None:
        keys, values = self.materialize()
        self.keys, self.values = gather_tokens(keys, index), gather_tokens(values, index)
        # copied at once into buffers with room, while the entries are still in the CPU's caches: the next append
        # then writes in place (a method evicting every step, H2O, no longer copies its cache twice a step)
        self._keep_spans(((0, index.shape[-1]),))

    def keep_ranges(self, kept: KeptRanges) -> None:
        if not self._slide(kept.spans):
            self._keep_spans(kept.spans)

    def _slide(self, spans: tuple[tuple[int, int], ...]) -> bool:
        """Keep ``spans`` in place when they drop only entries after the first few (a window, sinks + window) and the
        buffers have room for what is pending: the sinks move forward over the dropped entries, the held entries
        start after what they left, and the pending ones are written after the held. False when that cannot be
        done (the caller copies)."""
        *first, (recent, stop) = spans
        total = len(self)
        if self._room is None or stop != total or len(first) > 1 or (first and first[0][0] != 0):
            return False
        sinks = first[0][1] if first else 0
        dropped, held, start = recent - sinks, self.keys.shape[2], self._start
        if dropped <= 0 or sinks + dropped > held or start + total > self._room[0].shape[2]:
            return False
        for part, room in enumerate(self._room):  # keys, then values
            if sinks:  # cloned first: the sinks' old and new places overlap when fewer entries are dropped
                room[:, :, start + dropped:start + dropped + sinks].copy_(room[:, :, start:start + sinks].clone())
            cursor = start + held
            for entry in self.pending:
                room[:, :, cursor:cursor + entry[part].shape[2]].copy_(entry[part])
                cursor += entry[part].shape[2]
        self._hold(start + dropped, start + total)
        self.pending = []
        return True

    def _keep_spans(self, spans: tuple[tuple[int, int], ...]) -> None:
        """Hold only the entries in ``spans`` (cache-index ranges over stored + pending entries), copied once."""
        key_pieces, value_pieces = [], []
        for start, end in spans:
            offset = 0
            for keys, values in [(self.keys, self.values), *self.pending]:
                low, high = max(start, offset), min(end, offset + keys.shape[2])
                if low < high:
                    key_pieces.append(keys[:, :, low - offset:high - offset])
                    value_pieces.append(values[:, :, low - offset:high - offset])
                offset += keys.shape[2]
        kept = sum(piece.shape[2] for piece in key_pieces)
        room = kept + max(GROWTH_TOKENS, kept // 16)  # the next appends write in place (see append)
        self._room = (self.keys.new_empty(*self.keys.shape[:2], room, self.keys.shape[3]),
                      self.values.new_empty(*self.values.shape[:2], room, self.values.shape[3]))
        written = 0
        for key_piece, value_piece in zip(key_pieces, value_pieces, strict=True):
            self._room[0][:, :, written:written + key_piece.shape[2]].copy_(key_piece)
            self._room[1][:, :, written:written + key_piece.shape[2]].copy_(value_piece)
            written += key_piece.shape[2]
        self._hold(0, kept)
        self.pending, self.owned = [], True

    def _hold(self, start: int, stop: int) -> None:
        """Hold the buffers' entries ``[start, stop)``: ``keys`` and ``values`` become views of them."""
        self._start = start
        self.keys, self.values = self._room[0][:, :, start:stop], self._room[1][:, :, start:stop]

    def write_keys(self, index: torch.Tensor, keys: torch.Tensor) -> None:
        """Overwrite the keys at cache indices ``index`` (StreamingLLM's re-rotated sinks), in place when possible."""
        stored, _ = self.materialize()
        if self.owned:
            stored.index_copy_(2, index, keys)
        else:  # the tensor may be shared (a forked prefill): write into a copy
            self.keys, self.owned, self._room, self._start = stored.index_copy(2, index, keys), True, None, 0

    def overwrite(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the entries from cache index ``start`` on with ``keys``/``values`` (a quantizer's dequantized
        group), in place when this storage owns its tensors."""
        self.materialize()
        if not self.owned:  # the tensors may be shared (a forked prefill): copy them once, with room
            self._keep_spans(((0, len(self)),))
        stop = start + keys.shape[2]
        self.keys[:, :, start:stop].copy_(keys)
        self.values[:, :, start:stop].copy_(values)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending:
            self._keep_spans(((0, len(self)),))
        return self.keys, self.values

    def __len__(self) -> int:
        return sum(keys.shape[2] for keys, _ in [(self.keys, self.values), *self.pending] if keys is not None)

    def nbytes(self) -> StorageBytes:
        held = [(self.keys, self.values), *self.pending]
        return StorageBytes(full_precision=sum(tensor_bytes(keys, values) for keys, values in held))
