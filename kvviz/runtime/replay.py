"""The decode loop kvviz owns: explicit positions, greedy or seeded sampling, per-step memory records.

Why not ``model.generate``: eviction shrinks the cache, so the position of each new token must be passed explicitly
(its index in the full sequence, not the cache length), and methods that score tokens by attention must see every
step's attention. The ``full`` policy reproduces ``model.generate`` greedy output token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvviz.cache.attention import AttentionListener
from kvviz.cache.kvcache import KVCache
from kvviz.runtime.invariance import rows_as_they_come
from kvviz.runtime.progress import Progress


@dataclass
class Sampling:
    """Greedy when ``temperature`` is 0; otherwise softmax sampling with a seeded generator."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        scaled = logits.float() / self.temperature
        if self.top_k > 0:
            threshold = scaled.topk(min(self.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class DecodeTrace:
    """What one decode produced: tokens and what the cache held after each step."""

    token_ids: list[int] = field(default_factory=list)
    kv_bytes_per_step: list[int] = field(default_factory=list)
    step_logprobs: list[torch.Tensor] = field(default_factory=list)  # when requested: [vocab] per token


def forward_step(model: torch.nn.Module, cache: KVCache, token_ids: list[int], first_position: int, step: int,
                 device: str, listeners: Sequence[AttentionListener] = ()) -> torch.Tensor:
    """Feed ``token_ids`` at absolute positions ``first_position...``; return the last position's logits.
    ``listeners`` receive every layer's attention probabilities (:mod:`kvviz.cache.attention`)."""
    absolute = torch.arange(first_position, first_position + len(token_ids))
    position_ids, cache_position = cache.begin_forward(absolute, step)
    output = model(
        input_ids=torch.tensor([token_ids], device=device),
        **cache.forward_inputs(),
        position_ids=position_ids.to(device),
        cache_position=cache_position.to(device),
        use_cache=True,
        logits_to_keep=1,
        listeners=tuple(listeners),
    )
    return output.logits[0, -1]


def decode(
    model: torch.nn.Module,
    cache: KVCache,
    first_logits: torch.Tensor,
    max_new_tokens: int,
    device: str,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    forced_tokens: list[int] | None = None,
    keep_logprobs: bool = False,
    progress: Progress | None = None,
    suffix_tokens: list[int] | None = None,
) -> DecodeTrace:
    """Generate up to ``max_new_tokens`` after a prefilled (and possibly compressed) cache.

    ``forced_tokens`` teacher-forces the inputs (the method's own choices are still recorded in ``step_logprobs``),
    so sequences stay comparable with the full cache's. Decoding stops at an end-of-sequence token.
    ``suffix_tokens`` are fed one per step before generating, after the prompt was compressed: a question the method
    did not see at prefill (kvpress's query-agnostic setting). They count as decode steps in the ledger and in
    ``kv_bytes_per_step`` but are not part of ``token_ids``.
    """
    sampling = sampling or Sampling()
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    trace = DecodeTrace()
    logits = first_logits
    position = cache.prompt_length
    limit = len(forced_tokens) if forced_tokens is not None else max_new_tokens
    trace.kv_bytes_per_step.append(cache.nbytes().total)  # step 0: after prefill compression
    suffix = suffix_tokens or []
    with torch.inference_mode(), rows_as_they_come():  # one row, never in another run's forward
        for fed, token in enumerate(suffix, start=1):
            logits = forward_step(model, cache, [token], position, fed, device)
            position += 1
            trace.kv_bytes_per_step.append(cache.nbytes().total)
        for step in range(1, limit + 1):
            if keep_logprobs:
                trace.step_logprobs.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            token = forced_tokens[step - 1] if forced_tokens is not None else sampling.choose(logits, generator)
            trace.token_ids.append(token)
            if progress is not None:
                progress(step / limit, f"token {step}/{limit}")
            if step == limit or (forced_tokens is None and token in eos_ids):
                break
            logits = forward_step(model, cache, [token], position, len(suffix) + step, device)
            position += 1
            trace.kv_bytes_per_step.append(cache.nbytes().total)
    return trace


def eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config (falling back to the tokenizer's)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:  # random-weight benchmark models come without a tokenizer
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}
