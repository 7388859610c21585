"""The eviction ledger: which token each layer and KV head dropped, and when.

Compact by design: one int32 per (layer, KV head, token) holding the step at which that token was evicted
(0 = prefill compression, s >= 1 = decode step s, -1 = still cached). What a head kept at any step follows from it,
so an 8K-token prompt on a 30-layer, 3-KV-head model needs under 3 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEPT = -1


@dataclass
class EvictionLedger:
    """``windows``: per layer, a local layer's sliding window (None: global); a local layer's entries that slid out
    of its window are recorded like evictions, at the step they left (:meth:`slid_out` tells them apart)."""

    num_layers: int
    kv_heads: int
    prompt_length: int
    evicted_at: torch.Tensor  # [layers, kv_heads, capacity] int32
    windows: tuple[int | None, ...] = ()

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, prompt_length: int, capacity: int,
              windows: tuple[int | None, ...] = ()) -> EvictionLedger:
        table = torch.full((num_layers, kv_heads, capacity), KEPT, dtype=torch.int32)
        return cls(num_layers, kv_heads, prompt_length, table, tuple(windows))

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, or None for a global layer."""
        return self.windows[layer_idx] if self.windows else None

    def layer_kinds(self) -> list[str]:
        """``global`` or ``local W`` per layer, as the pages label kept maps."""
        return ["global" if self.window(layer) is None else f"local {self.window(layer)}"
                for layer in range(self.num_layers)]

    def slid_out(self, length: int | None = None) -> torch.Tensor:
        """[layers, kv_heads, length] True where a local layer dropped the token because its window moved past it (at
        the step the model's own cache drops it), not because a method chose to; all False on a global layer."""
        length = self.length if length is None else length
        table = self.evicted_at[..., :length]
        if not any(self.windows):
            return torch.zeros_like(table, dtype=torch.bool)
        windows = torch.tensor([w or 0 for w in self.windows], dtype=torch.int32).view(-1, 1, 1)
        # a token at position p leaves a local layer once the newest token is p + window - 1: the prompt's last
        # token is prompt_length - 1 (step 0), decode step s feeds position prompt_length - 1 + s
        leaves = (torch.arange(length, dtype=torch.int32) + windows - self.prompt_length).clamp_min(0)
        return (windows > 0) & (table >= 0) & (table == leaves)

    @property
    def length(self) -> int:
        """Tokens the ledger has seen (prompt plus generated)."""
        return self.evicted_at.shape[-1]

    def ensure(self, length: int) -> None:
        """Grow to cover ``length`` tokens (doubling, so appends stay amortised O(1))."""
        if length > self.length:
            grown = torch.full((self.num_layers, self.kv_heads, max(length, 2 * self.length)), KEPT, dtype=torch.int32)
            grown[..., : self.length] = self.evicted_at
            self.evicted_at = grown

    def record(self, layer_idx: int, step: int, removed_positions: torch.Tensor) -> None:
        """``removed_positions`` [H_kv, r] absolute positions evicted from this layer at ``step``.

        The ledger must already cover them (:meth:`ensure`, called once per step by the cache rather than per layer).
        """
        if removed_positions.numel():
            self.evicted_at[layer_idx].scatter_(1, removed_positions.cpu(), step)

    def record_per_head(self, layer_idx: int, step: int, positions: torch.Tensor, removed: torch.Tensor) -> None:
        """Heads removing different numbers of entries: ``positions`` [H_kv, T] and a bool ``removed`` [H_kv, T]."""
        for head in range(positions.shape[0]):
            self.evicted_at[layer_idx, head, positions[head][removed[head]].cpu()] = step

    def trimmed(self, total_length: int) -> EvictionLedger:
        """A copy covering exactly ``total_length`` tokens (drops unused growth room)."""
        self.ensure(total_length)
        return EvictionLedger(self.num_layers, self.kv_heads, self.prompt_length,
                              self.evicted_at[..., :total_length].clone(), self.windows)

    def kept_mask(self, step: int, length: int | None = None) -> torch.Tensor:
        """[layers, kv_heads, length] True where the token was cached after ``step`` (and had arrived by then)."""
        length = self.length if length is None else length
        table = self.evicted_at[..., :length]
        arrived = torch.arange(length) < self.prompt_length + max(step, 0)
        return ((table == KEPT) | (table > step)) & arrived

    def survived(self, positions: list[int], step: int | None = None) -> torch.Tensor:
        """[layers, kv_heads] True where every listed position was still cached after ``step`` (default: the end)."""
        columns = self.evicted_at[..., positions]
        if step is None:
            return (columns == KEPT).all(dim=-1)
        return ((columns == KEPT) | (columns > step)).all(dim=-1)

    def nbytes(self) -> int:
        return self.evicted_at.numel() * self.evicted_at.element_size()

    def to_json(self, total_length: int) -> dict:
        """The compact form compare's JSON carries (documented in docs/cli.md).

        ``evicted_at``: per layer, per KV head, a list of [position, step] pairs for evicted tokens only.
        ``kept_per_layer``: per layer, tokens still cached per KV head at the end.
        ``layer_types``: per layer, ``global`` or ``local W`` (a local layer's window drops count as evictions).
        """
        table = self.evicted_at[..., :total_length]
        evicted = [
            [torch.nonzero(table[layer, head] != KEPT).flatten().tolist() for head in range(self.kv_heads)]
            for layer in range(self.num_layers)
        ]
        return {
            "encoding": "evicted_at[layer][kv_head] = [[position, step], ...]; step 0 = prefill, s = decode step s",
            "prompt_length": self.prompt_length,
            "total_length": total_length,
            "layer_types": self.layer_kinds(),
            "kept_per_layer": (table == KEPT).sum(dim=-1).tolist(),
            "evicted_at": [
                [[[p, int(table[layer, head, p])] for p in evicted[layer][head]] for head in range(self.kv_heads)]
                for layer in range(self.num_layers)
            ],
        }
