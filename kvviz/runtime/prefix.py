"""Prefix reuse: prefilled KV kept in fixed-size token blocks, keyed by a chained hash, as vLLM's prefix cache does.

A block's key hashes its tokens together with its parent block's key, so a key names the block *and everything
before it*: changing one token changes that block's key and every later one, and a lookup walks the prompt's
blocks from the start until the first miss. A prompt then feeds only the tokens after its longest cached block
prefix, at their absolute positions, into a cache seeded with the reused blocks. Only whole blocks are stored, and
at least one token is always fed (its logits are the answer's first token). A salt starts the chain somewhere else,
which keeps namespaces (users, adapters) apart. Blocks are evicted least recently used first under a byte budget;
a chain's tail is evicted before its head, so a partly evicted chain still serves its first blocks.

What a partial prefill can serve: the fed tokens' queries see every key (the reused ones too), so anything computed
from the *last* queries is exact, and an observation window (SnapKV, TOVA) is served when the fed tail covers it.
Statistics over every query (H2O's received attention, sink mass per query, attention matrices) and kvpress's
layer inputs need the reused tokens' queries or hidden states, which a reused block does not have: such captures
prefill the whole prompt (:func:`reusable_tokens` says 0).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvviz.cache.capture import CaptureConfig
from kvviz.cache.kvcache import KVCache
from kvviz.runtime.batch import prefill_rows
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.replay import forward_step

BLOCK_TOKENS = 16  # vLLM's default block size
BUDGET_BYTES = 512 * 2**20  # per loaded model: about 11K tokens of SmolLM2-135M in float32
PREAMBLE_FILE = Path(__file__).resolve().parents[2] / "assets" / "prefix_preamble.txt"
DEFAULT_QUESTIONS = (
    "Can I take my bicycle and a kayak on the 14:00 sailing to the Rock, and what will that cost?",
    "I use a wheelchair and I am driving to Kilmory in August. How do I board?",
)
TIMESTAMP = "Current date and time: 2026-11-29 22:41:07 UTC."


def default_preamble() -> str:
    """A help-desk system prompt with few-shot examples in ChatML (about 1.1K SmolLM2 tokens)."""
    return PREAMBLE_FILE.read_text(encoding="utf-8")


def question_turn(preamble: str, question: str) -> str:
    """The text appended to ``preamble`` to ask ``question``: a ChatML user turn when the preamble is ChatML."""
    if "<|im_start|>" in preamble:
        return f"<|im_start|>user\n{question.strip()}<|im_end|>\n<|im_start|>assistant\n"
    return f"\nQuestion: {question.strip()}\nAnswer:"


def turn_ids(tokenizer, preamble: str, question: str) -> tuple[list[int], list[int]]:
    """Preamble and question tokenized apart, so every question's prompt starts with the very same preamble ids
    (tokenizing the joined text could merge tokens across the seam)."""
    return ([int(i) for i in tokenizer(preamble)["input_ids"]],
            [int(i) for i in tokenizer(question_turn(preamble, question))["input_ids"]])


def edit_preamble(preamble: str, edit: str, line: int) -> str:
    """The preamble with one byte-level change after its line ``line`` (0-based): ``timestamp`` inserts a date line,
    ``reorder`` swaps that line with the next one. Every block from the change on gets a new hash."""
    lines = preamble.split("\n")
    line = max(0, min(line, len(lines) - 2))
    if edit == "timestamp":
        lines.insert(line + 1, TIMESTAMP)
    elif edit == "reorder":
        lines[line], lines[line + 1] = lines[line + 1], lines[line]
    else:
        raise ValueError(f"unknown edit {edit!r}; choose timestamp or reorder")
    return "\n".join(lines)


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


def reusable_tokens(capture: CaptureConfig | None, prompt_length: int) -> int:
    """How many leading prompt tokens may come from the prefix cache while still serving ``capture``.

    The last token is always fed; an observation window's queries must all be fed; captures over every query or
    every token's hidden state (see the module docstring) allow none.
    """
    if capture is not None and (capture.all_queries or capture.matrices or capture.layer_inputs):
        return 0
    window = capture.window_rows if capture is not None else 0
    return max(0, prompt_length - max(1, window))


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
    """Counters over a prefix cache's life."""

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


def prefix_cache_for(loaded: LoadedModel) -> PrefixCache:
    """The prefix cache shared by every run on ``loaded`` (made on first use)."""
    with loaded.lock:
        cache = getattr(loaded, "prefix_cache", None)
        if cache is None:
            cache = PrefixCache()
            loaded.prefix_cache = cache
        return cache


@dataclass
class PrefixPrefill:
    """A prompt prefilled through a prefix cache: the dense cache, last logits, the block table, the time taken."""

    cache: KVCache
    last_logits: torch.Tensor
    lookup: PrefixLookup
    seconds: float


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _seeded(prefix: PrefixCache | None, token_ids: list[int], limit: int | None,
            num_layers: int) -> tuple[PrefixLookup, KVCache]:
    """The prompt's block table and a cache holding its reused blocks (nothing reused without a prefix cache)."""
    if prefix is None:
        lookup, cache = PrefixLookup(len(token_ids), BLOCK_TOKENS, [], 0), KVCache(num_layers)
    else:
        lookup = prefix.lookup(token_ids, limit)
        cache = prefix.seed(lookup, num_layers)
    cache.prompt_length = len(token_ids)
    return lookup, cache


def prefill_with_prefix(loaded: LoadedModel, token_ids: list[int], prefix: PrefixCache | None,
                        limit: int | None = None, store: bool = True) -> PrefixPrefill:
    """Prefill ``token_ids``, reusing ``prefix``'s longest block prefix (within ``limit`` tokens) and feeding only
    the rest; store the new whole blocks after. ``prefix=None`` is a fresh prefill (every block a miss).

    Attention listeners active around the call see the fed tokens' queries only (see :func:`reusable_tokens`).
    """
    _sync(loaded.device)
    started = time.perf_counter()
    lookup, cache = _seeded(prefix, token_ids, limit, loaded.config.num_hidden_layers)
    start = lookup.reused_tokens
    with torch.inference_mode():
        logits = forward_step(loaded.model, cache, token_ids[start:], start, 0, loaded.device)
    _sync(loaded.device)
    seconds = time.perf_counter() - started
    if prefix is not None and store:
        prefix.store(token_ids, cache)
    return PrefixPrefill(cache, logits, lookup, seconds)


def prefill_together(loaded: LoadedModel, prompts: list[list[int]],
                     prefix: PrefixCache | None) -> list[PrefixPrefill | BaseException]:
    """Several runs' prompts in one forward (:func:`kvviz.runtime.batch.prefill_rows`), each reusing its own longest
    cached prefix and storing its new blocks after, as :func:`prefill_with_prefix` does alone; nobody listens to
    their attention. Each result's ``seconds`` is the whole forward's, which is how long each prompt waited for its
    first token. A row that failed gets its error in place of its prefill."""
    if len(prompts) == 1:
        return [prefill_with_prefix(loaded, prompts[0], prefix)]
    _sync(loaded.device)
    started = time.perf_counter()
    seeded = [_seeded(prefix, tokens, None, loaded.config.num_hidden_layers) for tokens in prompts]
    starts = [lookup.reused_tokens for lookup, _ in seeded]
    caches = [cache for _, cache in seeded]
    with torch.inference_mode():
        logits, failures = prefill_rows(loaded.model, caches, [t[s:] for t, s in zip(prompts, starts, strict=True)],
                                        starts, loaded.device)
    _sync(loaded.device)
    seconds = time.perf_counter() - started
    results: list[PrefixPrefill | BaseException] = []
    for index, (tokens, (lookup, cache)) in enumerate(zip(prompts, seeded, strict=True)):
        if index in failures:
            results.append(failures[index])
            continue
        if prefix is not None:
            prefix.store(tokens, cache)
        results.append(PrefixPrefill(cache, logits[index], lookup, seconds))
    return results


@dataclass
class TurnResult:
    """One prompt of a conversation sharing a preamble: its block table, time to first token fresh and with reuse,
    and how far the reused logits are from the fresh ones."""

    label: str
    prompt_tokens: int
    lookup: PrefixLookup
    ttft_fresh: float
    ttft_reused: float
    max_logit_diff: float
    same_next_token: bool
    kv_bytes: int

    @property
    def speedup(self) -> float:
        return self.ttft_fresh / self.ttft_reused if self.ttft_reused > 0 else float("inf")


@dataclass
class ReuseReport:
    """Turns run through one fresh prefix cache, in order."""

    block_tokens: int
    turns: list[TurnResult] = field(default_factory=list)

    def to_rows(self) -> list[dict]:
        return [{"turn": t.label, "prompt_tokens": t.prompt_tokens, "hit_blocks": t.lookup.hits,
                 "miss_blocks": t.lookup.misses, "reused_tokens": t.lookup.reused_tokens,
                 "ttft_fresh_s": t.ttft_fresh, "ttft_reused_s": t.ttft_reused,
                 "max_logit_diff": t.max_logit_diff, "same_next_token": t.same_next_token} for t in self.turns]

    def block_tables(self) -> list[list[str]]:
        """Per turn, each block's status (hit, miss, recomputed, partial)."""
        return [[b.status for b in t.lookup.blocks] for t in self.turns]

    def lines(self) -> list[str]:
        """One line per turn: blocks hit, tokens reused, time to first token with and without reuse."""
        return [f"  {t.label[:48]!r}: {t.prompt_tokens} tokens, {t.lookup.hits}/{len(t.lookup.blocks)} blocks hit "
                f"({t.lookup.reused_tokens} tokens reused), TTFT {t.ttft_reused * 1000:.0f} ms vs "
                f"{t.ttft_fresh * 1000:.0f} ms fresh ({t.ttft_reused / t.ttft_fresh:.2f}x), "
                f"max |logit diff| {t.max_logit_diff:.2e}" for t in self.turns]


def run_turns(loaded: LoadedModel, prompts: list[list[int]], labels: list[str] | None = None,
              block_tokens: int = BLOCK_TOKENS, repeats: int = 1, progress=None) -> ReuseReport:
    """Run ``prompts`` in order through a new prefix cache (so the first one misses everywhere): each turn is timed
    fresh and with reuse (best of ``repeats``, alternated so a slow spell of a shared machine hits both) and its
    reused logits compared with the fresh ones. Hold ``loaded.lock`` or call from one thread per model."""
    prefix = PrefixCache(block_tokens=block_tokens, budget_bytes=2**62)
    report = ReuseReport(block_tokens)
    prefill_with_prefix(loaded, prompts[0][:block_tokens], None)  # warm-up: the first forward pays one-off costs
    labels = labels or [f"turn {i + 1}" for i in range(len(prompts))]
    for turn, (label, ids) in enumerate(zip(labels, prompts, strict=True)):
        if progress is not None:
            progress(turn / len(prompts), f"{label}: prefill fresh and with reuse")
        fresh_times, reused_times = [], []
        fresh = reused = None
        for _ in range(max(1, repeats)):  # repeats reuse the same blocks: nothing is stored until the turn ends
            fresh = prefill_with_prefix(loaded, ids, None)
            fresh_times.append(fresh.seconds)
            reused = prefill_with_prefix(loaded, ids, prefix, store=False)
            reused_times.append(reused.seconds)
        prefix.store(ids, reused.cache)
        diff = float((reused.last_logits.float() - fresh.last_logits.float()).abs().max())
        report.turns.append(TurnResult(label, len(ids), reused.lookup, min(fresh_times), min(reused_times), diff,
                                       int(reused.last_logits.argmax()) == int(fresh.last_logits.argmax()),
                                       fresh.cache.nbytes().total))
    if progress is not None:
        progress(1.0, "done")
    return report


@dataclass
class LengthCost:
    """Measured prefill time and dense cache bytes at one prompt length."""

    tokens: int
    prefill_seconds: float
    kv_bytes: int


def context_cost(loaded: LoadedModel, token_ids: list[int], lengths: list[int], progress=None) -> list[LengthCost]:
    """Prefill time and cache bytes for the first ``n`` tokens of ``token_ids`` (repeated when shorter) per length."""
    costs = []
    for index, length in enumerate(lengths):
        if progress is not None:
            progress(index / len(lengths), f"prefill of {length} tokens")
        ids = (token_ids * (length // max(1, len(token_ids)) + 1))[:length]
        run = prefill_with_prefix(loaded, ids, None)
        costs.append(LengthCost(length, run.seconds, run.cache.nbytes().total))
    return costs
