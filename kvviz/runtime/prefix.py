"""The prefix cache: prefilled KV kept in fixed-size token blocks, keyed by a chained hash, as vLLM's prefix cache does.

A block's key hashes its tokens together with its parent block's key, so a key names the block *and everything
before it*: changing one token changes that block's key and every later one, and a lookup walks the prompt's
blocks from the start until the first miss. Only whole blocks are stored. A salt starts the chain somewhere else,
which keeps namespaces (users, adapters) apart. Blocks are evicted least recently used first under a byte budget;
a chain's tail is evicted before its head, so a partly evicted chain still serves its first blocks. Prefilling a
prompt through the cache (feeding only what it does not hold) is :mod:`kvviz.runtime.prefill`.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvviz.cache.kvcache import KVCache

BLOCK_TOKENS = 16  # vLLM's default block size
BUDGET_BYTES = 512 * 2**20  # per loaded model: about 11K tokens of SmolLM2-135M in float32


def block_hashes(token_ids: list[int], block_tokens: int = BLOCK_TOKENS, salt: str = "") -> list[str]:
    """Chained hashes (hex SHA-256) of the whole ``block_tokens`` blocks of ``token_ids``; a trailing part is left out.

    Block i's hash covers its parent's hash and its own tokens, so equal hashes mean equal prefixes.
    """
    parent = hashlib.sha256(b"kvviz-prefix\0" + salt.encode()).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = np.asarray(token_ids[start:start + block_tokens], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent.hex())
    return hashes


def shared_prefixes(prompts: Sequence[Sequence[int]], block_tokens: int = BLOCK_TOKENS) -> list[list[int]]:
    """The longest whole-block prefixes that two or more of ``prompts`` share, each once, in the prompts' order; a
    prefix that is the start of a longer one is left out (storing the longer one's blocks serves it too)."""
    ordered = sorted(range(len(prompts)), key=lambda index: list(prompts[index]))
    longest = [0] * len(prompts)
    for before, after in itertools.pairwise(ordered):  # sorted, a prompt's longest match is a neighbour
        first, second = prompts[before], prompts[after]
        common = next((k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
                      min(len(first), len(second)))
        whole = common // block_tokens * block_tokens
        longest[before], longest[after] = max(longest[before], whole), max(longest[after], whole)
    found: dict[tuple[int, ...], None] = {}
    for index, length in enumerate(longest):
        if length:
            found.setdefault(tuple(prompts[index][:length]))
    kept = [p for p in found if not any(len(q) > len(p) and q[:len(p)] == p for q in found)]
    return [list(prefix) for prefix in kept]


@dataclass
class BlockStatus:
    """One block of a prompt in a lookup: ``hit`` (reused), ``miss`` (prefilled, then stored), ``recomputed`` (cached
    but fed anyway: the fed tail had to start earlier) or ``partial`` (the trailing part block, never stored)."""

    index: int
    start: int
    end: int
    hash: str
    status: str


@dataclass
class PrefixLookup:
    """A prompt's block table against the cache, and how many leading tokens it reuses."""

    prompt_tokens: int
    block_tokens: int
    blocks: list[BlockStatus]
    reused_tokens: int

    @property
    def hits(self) -> int:
        return sum(block.status == "hit" for block in self.blocks)

    @property
    def misses(self) -> int:
        return sum(block.status == "miss" for block in self.blocks)

    @property
    def first_miss(self) -> int | None:
        """Index of the first whole block not reused, or None when every whole block was."""
        return next((b.index for b in self.blocks if b.status in ("miss", "recomputed")), None)


@dataclass
class CachedBlock:
    """One block's keys and values in every layer ([1, H_kv, block, D] each), cloned out of a prefill."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])


@dataclass
class PrefixStats:
    """Counters over a prefix cache's life, in blocks: found by lookups (hits) or not (misses), stored after a
    prefill, evicted under the byte budget."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of prefilled KV under a byte budget, least recently used evicted first. Thread-safe (one lock)."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, budget_bytes: int = BUDGET_BYTES, salt: str = ""):
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self.budget_bytes = budget_bytes
        self.salt = salt
        self.stats = PrefixStats()
        self._blocks: OrderedDict[str, CachedBlock] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    @property
    def nbytes(self) -> int:
        return self._bytes

    def hashes(self, token_ids: list[int], salt: str | None = None) -> list[str]:
        return block_hashes(token_ids, self.block_tokens, self.salt if salt is None else salt)

    def lookup(self, token_ids: list[int], limit: int | None = None, salt: str | None = None) -> PrefixLookup:
        """The block table of ``token_ids``: the longest cached block prefix, cut to whole blocks within ``limit``
        tokens (default: all but the last token). Touches the reused blocks (most recent)."""
        limit = len(token_ids) - 1 if limit is None else min(limit, len(token_ids) - 1)
        size = self.block_tokens
        hashes = self.hashes(token_ids, salt)
        with self._lock:
            cached = 0
            while cached < len(hashes) and hashes[cached] in self._blocks:
                cached += 1
            reused = min(cached, max(0, limit) // size)
            blocks = [BlockStatus(i, i * size, (i + 1) * size, h, "hit" if i < reused else
                                  "recomputed" if i < cached else "miss") for i, h in enumerate(hashes)]
            if len(token_ids) % size:
                blocks.append(BlockStatus(len(hashes), len(hashes) * size, len(token_ids), "", "partial"))
            self._touch(hashes[:reused])
            self.stats.hit_blocks += reused
            self.stats.miss_blocks += len(hashes) - reused
        return PrefixLookup(len(token_ids), size, blocks, reused * size)

    def seed(self, lookup: PrefixLookup, num_layers: int) -> KVCache:
        """A dense cache holding the lookup's reused blocks at positions 0..reused-1 (empty when none)."""
        cache = KVCache(num_layers)
        hits = [block.hash for block in lookup.blocks if block.status == "hit"]
        if not hits:
            return cache
        with self._lock:
            chain = [self._blocks[h] for h in hits]
        for layer_idx, layer in enumerate(cache.layers):
            keys = torch.cat([block.keys[layer_idx] for block in chain], dim=2)
            values = torch.cat([block.values[layer_idx] for block in chain], dim=2)
            layer.lazy_initialization(keys, values)
            layer.storage.append(keys, values)
            batch, heads, length = keys.shape[:3]
            positions = torch.arange(length, device=keys.device).expand(batch, heads, length)
            layer.positions, layer.rotary = positions.clone(), positions.clone()
        return cache

    def store(self, token_ids: list[int], cache: KVCache, salt: str | None = None) -> int:
        """Copy the whole blocks of a prefilled dense ``cache`` (holding ``token_ids`` at positions 0..) that are not
        cached yet; evict down to the budget. Returns the number of blocks stored."""
        hashes = self.hashes(token_ids, salt)
        size = self.block_tokens
        layers = [layer.storage.materialize() for layer in cache.layers]
        stored = 0
        with self._lock:
            for index, block_hash in enumerate(hashes):
                if block_hash in self._blocks:
                    continue
                span = slice(index * size, (index + 1) * size)
                block = CachedBlock([keys[:, :, span].clone() for keys, _ in layers],
                                    [values[:, :, span].clone() for _, values in layers])
                if block.nbytes > self.budget_bytes:
                    break
                self._blocks[block_hash] = block
                self._bytes += block.nbytes
                stored += 1
            self._touch(hashes)
            self.stats.stored_blocks += stored
            self._evict()
        return stored

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def _touch(self, chain: list[str]) -> None:
        """Mark a chain most recently used, its head last: eviction then takes a chain's tail before its head."""
        for block_hash in reversed(chain):
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            self.stats.evicted_blocks += 1
