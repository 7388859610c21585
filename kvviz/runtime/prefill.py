"""Prefilling through a prefix cache (:mod:`kvviz.runtime.prefix`): a prompt feeds only the tokens after its longest
cached block prefix, at their absolute positions, into a cache seeded with the reused blocks, and stores its new whole
blocks after. At least one token is always fed (its logits are the answer's first token).

What a partial prefill can serve: the fed tokens' queries see every key (the reused ones too), so anything computed
from the *last* queries is exact, and an observation window (SnapKV, TOVA) is served when the fed tail covers it.
Statistics over every query (H2O's received attention, sink mass per query, attention matrices) and kvpress's
layer inputs need the reused tokens' queries or hidden states, which a reused block does not have: such captures
prefill the whole prompt (:func:`reusable_tokens` says 0).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvviz.cache.attention import AttentionListener
from kvviz.cache.capture import CaptureConfig
from kvviz.cache.kvcache import KVCache
from kvviz.runtime.batch import prefill_rows
from kvviz.runtime.prefix import BLOCK_TOKENS, PrefixCache, PrefixLookup
from kvviz.runtime.replay import forward_step


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


def prefill_with_prefix(model: torch.nn.Module, device: str, token_ids: list[int], prefix: PrefixCache | None,
                        limit: int | None = None, store: bool = True,
                        listeners: Sequence[AttentionListener] = ()) -> PrefixPrefill:
    """Prefill ``token_ids`` on ``model``, reusing ``prefix``'s longest block prefix (within ``limit`` tokens) and
    feeding only the rest; store the new whole blocks after. ``prefix=None`` is a fresh prefill (every block a miss).

    ``listeners`` see the fed tokens' queries only (see :func:`reusable_tokens`).
    """
    _sync(device)
    started = time.perf_counter()
    lookup, cache = _seeded(prefix, token_ids, limit, model.config.num_hidden_layers)
    start = lookup.reused_tokens
    with torch.inference_mode():
        logits = forward_step(model, cache, token_ids[start:], start, 0, device, listeners)
    _sync(device)
    seconds = time.perf_counter() - started
    if prefix is not None and store:
        prefix.store(token_ids, cache)
    return PrefixPrefill(cache, logits, lookup, seconds)


def prefill_together(model: torch.nn.Module, device: str, prompts: list[list[int]],
                     prefix: PrefixCache | None, store: bool = True) -> list[PrefixPrefill | BaseException]:
    """Several runs' prompts in one forward (:func:`kvviz.runtime.batch.prefill_rows`), each reusing its own longest
    cached prefix and storing its new blocks after (unless ``store`` is False), as :func:`prefill_with_prefix` does
    alone; nobody listens to their attention. Each result's ``seconds`` is the whole forward's, which is how long each
    prompt waited for its first token. A row that failed gets its error in place of its prefill."""
    if len(prompts) == 1:
        return [prefill_with_prefix(model, device, prompts[0], prefix, store=store)]
    _sync(device)
    started = time.perf_counter()
    seeded = [_seeded(prefix, tokens, None, model.config.num_hidden_layers) for tokens in prompts]
    starts = [lookup.reused_tokens for lookup, _ in seeded]
    caches = [cache for _, cache in seeded]
    with torch.inference_mode():
        logits, failures = prefill_rows(model, caches, [t[s:] for t, s in zip(prompts, starts, strict=True)], starts,
                                        device)
    _sync(device)
    seconds = time.perf_counter() - started
    results: list[PrefixPrefill | BaseException] = []
    for index, (tokens, (lookup, cache)) in enumerate(zip(prompts, seeded, strict=True)):
        if index in failures:
            results.append(failures[index])
            continue
        if prefix is not None and store:
            prefix.store(tokens, cache)
        results.append(PrefixPrefill(cache, logits[index], lookup, seconds))
    return results
