"""One prompt, many methods: prefill once (with attention statistics when asked), then fork a cache per method.

A comparison of N methods costs one prefill plus N decodes, batched into one (:mod:`kvviz.runtime.batch`).
Prefill-time selection (SnapKV, H2O's initial scores) reads the shared statistics, so forking is exactly what an
independent run of that method would do.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvviz.cache.architecture import ArchitectureStorage, axis_factors
from kvviz.cache.attention import AttentionListener
from kvviz.cache.capture import CaptureConfig, recording_layer_inputs
from kvviz.cache.kvcache import KVCache
from kvviz.cache.ledger import EvictionLedger
from kvviz.cache.protect import protected_positions
from kvviz.cache.rotation import rope_rotator
from kvviz.cache.stats import AttentionStats, StatsRecorder
from kvviz.comparison.diagnostics import quantization_report
from kvviz.comparison.metrics import forced_comparison
from kvviz.comparison.results import Comparison, MethodResult
from kvviz.methods import MethodStack, SpecError, parse_spec
from kvviz.planning.memory import model_card
from kvviz.runtime.admission import RunSize
from kvviz.runtime.batch import ROW_ERRORS, DecodeGroup, Row
from kvviz.runtime.jobs import Decode, Job, SharedPrefill, Stage, Steps
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.prefill import PrefixPrefill, prefill_with_prefix, reusable_tokens
from kvviz.runtime.progress import Progress, share
from kvviz.runtime.replay import DecodeTrace, Sampling, decode, eos_token_ids
from kvviz.runtime.threads import small_work

FORKING = 0.05  # the share of a batched comparison's progress bar its forks take (its decode takes the rest)


class PromptError(ValueError):
    """A prompt, or the arguments a study builds its prompts from (lengths, depths, mode, trials), that cannot be
    run; the message is one line meant for the user (the CLI exits 2 on it)."""


def check_context(loaded: LoadedModel, tokens: int, room: int = 1, what: str = "the prompt") -> None:
    """PromptError unless ``tokens`` plus ``room`` more (positions still to come) fit in the model's context."""
    context = loaded.context_length
    if context and tokens + room > context:
        raise PromptError(f"{what} has {tokens} tokens; this model's context is {context}")


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; ``chat`` wraps it as one user turn in the model's chat template."""
    if not text or not text.strip():
        raise PromptError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("this model has no chat template; run without --chat")
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    else:
        ids = tokenizer(text)["input_ids"]
    return [int(i) for i in ids]


def capture_for(stacks: list[MethodStack]) -> CaptureConfig | None:
    """The prefill capture these methods read (one capture serves them all, so the prompt runs once), or None.

    Each eviction method declares its own needs in its schedule (:attr:`~kvviz.cache.protocol.Schedule.capture`).
    """
    return CaptureConfig.uniting(s.eviction.schedule.capture for s in stacks if s.eviction is not None)


@dataclass
class Prefill:
    """The shared result of one prompt's forward pass."""

    cache: KVCache
    last_logits: torch.Tensor
    stats: AttentionStats | None
    seconds: float
    reused_tokens: int = 0  # leading prompt tokens taken from the model's prefix cache (kvviz.runtime.prefix)


class PromptSession:
    """A loaded model and one tokenized prompt. Not thread-safe: its forwards belong in a job's steps, which the
    model's engine runs (:mod:`kvviz.runtime.engine`)."""

    def __init__(self, loaded: LoadedModel, prompt_ids: list[int], reuse_prefix: bool = False):
        """``reuse_prefix``: prefill through the model's prefix cache when the capture allows (kvviz.runtime.prefix)."""
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        check_context(loaded, len(prompt_ids))
        self.loaded = loaded
        self.prompt_ids = prompt_ids
        self.card = model_card(loaded)
        self.rotate_keys = rope_rotator(loaded.model)
        self.eos_ids = eos_token_ids(loaded.model, loaded.tokenizer)
        self._prefill: Prefill | None = None
        self._capture: CaptureConfig | None = None
        self.reuse_prefix = reuse_prefix

    @property
    def num_layers(self) -> int:
        return self.card.layers

    def prefill(self, capture: CaptureConfig | None = None, listeners: Sequence[AttentionListener] = ()) -> Prefill:
        """Run the prompt once into a dense cache; reuse it while the capture asked for is covered. ``listeners``
        see the prompt's attention beside the capture's recorder (when it runs)."""
        covered = capture is None or (self._capture is not None and self._capture.covers(capture))
        if self._prefill is not None and covered:
            return self._prefill
        limit = reusable_tokens(capture, len(self.prompt_ids)) if self.reuse_prefix else 0
        recorder = StatsRecorder(capture, len(self.prompt_ids)) if capture is not None else None
        inputs = (recording_layer_inputs(self.loaded.model, recorder.stats.layer_inputs)
                  if capture is not None and capture.layer_inputs else contextlib.nullcontext())
        with inputs:
            run = prefill_with_prefix(self.loaded.model, self.loaded.device, self.prompt_ids,
                                      self.loaded.prefix_cache if self.reuse_prefix else None, limit,
                                      listeners=[*listeners, *([recorder] if recorder else [])])
        self._prefill = Prefill(run.cache, run.last_logits, recorder.finish() if recorder else None, run.seconds,
                                run.lookup.reused_tokens)
        self._capture = capture
        return self._prefill

    def adopt(self, run: PrefixPrefill) -> None:
        """Take a prefill of this prompt that ran elsewhere (the engine's shared prefill, a forward with other runs'
        prompts), with no capture."""
        self._prefill = Prefill(run.cache, run.last_logits, None, run.seconds, run.lookup.reused_tokens)
        self._capture = None

    def fork(self, stack: MethodStack, ledger: bool = True, protect: list[tuple[int, int]] | None = None) -> KVCache:
        """A cache for ``stack`` holding the prompt, compressed as the method decides after prefill.

        ``protect``: ``[start, end)`` token spans no eviction may drop (:mod:`kvviz.cache.protect`).
        """
        if stack.eviction is not None:
            stack.eviction.check_context(len(self.prompt_ids))
        heads = self.card.kv_heads
        if stack.architecture is not None:
            stack.architecture.check_model(self.card.kv_heads, self.card.head_dim)
            heads = stack.architecture.cache_heads(heads)
        if stack.eviction is not None and stack.eviction.rerotate and self.rotate_keys is not None:
            self.rotate_keys.check()
        prefill = self.prefill_for(stack)
        book = None
        if ledger and (stack.eviction is not None or self.card.layer_types.has_local):  # local layers slide anyway
            book = EvictionLedger.empty(self.num_layers, heads, len(self.prompt_ids), len(self.prompt_ids) + 64,
                                        self.card.layer_types.windows)
        protected = protected_positions(protect) if protect else None
        with small_work(self.loaded.device):  # thousands of small kernels (a quantizer's groups, a selection)
            return KVCache.fork(prefill.cache, stack, prefill.stats, book, self.rotate_keys, protected,
                                self.card.layer_types)

    def prefill_for(self, stack: MethodStack) -> Prefill:
        """The prefill ``stack`` forks from: the shared one, or its own for a method that must run the prompt itself
        (kvpress's hooks compress during the forward: ``Schedule.own_prefill``)."""
        if stack.eviction is not None and stack.eviction.schedule.own_prefill:
            own = stack.eviction.run_prefill(self)
            return Prefill(own.cache, own.last_logits, own, own.seconds)
        wanted = capture_for([stack])
        return self.prefill(self._capture.merged(wanted) if self._capture is not None else wanted)

    def _detokenize(self, token_ids: list[int]) -> str:
        """Generated text; random-weight benchmark models have no tokenizer and no text."""
        tokenizer = self.loaded.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=True)

    def run(self, spec: str | MethodStack, max_new_tokens: int, sampling: Sampling | None = None,
            forced_tokens: list[int] | None = None, keep_logprobs: bool = False,
            progress: Progress | None = None,
            suffix_tokens: list[int] | None = None,
            protect: list[tuple[int, int]] | None = None) -> tuple[MethodResult, DecodeTrace]:
        """Fork a cache for one method and decode; returns the result and the raw trace.

        ``suffix_tokens`` are fed after compression, before generating (see :func:`kvviz.runtime.replay.decode`);
        ``protect`` spans are never evicted (:mod:`kvviz.cache.protect`).
        """
        stack = parse_spec(spec) if isinstance(spec, str) else spec
        started = time.perf_counter()
        cache = self.fork(stack, protect=protect)
        prefill = self.prefill_for(stack)
        trace = decode(self.loaded.model, cache, prefill.last_logits, max_new_tokens, self.loaded.device,
                       self.eos_ids, sampling, forced_tokens, keep_logprobs, progress, suffix_tokens)
        return self.result(stack, cache, trace, time.perf_counter() - started, len(suffix_tokens or [])), trace

    def result(self, stack: MethodStack, cache: KVCache, trace: DecodeTrace, seconds: float,
               suffix_length: int = 0) -> MethodResult:
        """What a finished decode of ``stack`` reports: text, bytes (per step, per layer, split) and the ledger."""
        fed = suffix_length + max(0, len(trace.token_ids) - 1)  # the last token is never fed
        total_tokens = len(self.prompt_ids) + fed
        breakdown = cache.nbytes()
        key_dim, value_dim = self.card.cached_dims
        return MethodResult(
            method=stack.label,
            text=self._detokenize(trace.token_ids),
            token_ids=trace.token_ids,
            kv_bytes=breakdown.total,
            kv_bytes_full=self.card.stored_kv_bytes(total_tokens),
            kv_breakdown=breakdown,
            kv_bytes_per_step=trace.kv_bytes_per_step,
            kv_bytes_per_layer=cache.nbytes_per_layer(),
            seconds=seconds,
            ledger=cache.ledger.trimmed(total_tokens) if cache.ledger is not None else None,
            axis_factors=axis_factors(cache, self.card.kv_heads, key_dim, total_tokens, self.card.bytes_per_element,
                                      self.card.stored_kv_bytes(total_tokens), value_dim),
            projection_bytes=sum(layer.storage.weight_bytes() for layer in cache.layers
                                 if isinstance(layer.storage, ArchitectureStorage)),
            native_report=(stack.eviction.report if stack.eviction is not None and stack.eviction.schedule.own_prefill
                           else None),
            total_tokens=total_tokens,
        )


def compare(
    loaded: LoadedModel,
    prompt_ids: list[int],
    specs: list[str],
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    progress: Progress | None = None,
    batched: bool = True,
    reuse_prefix: bool = True,
) -> Comparison:
    """Replay ``specs`` on one prompt; ``full`` runs first (added if missing) and is everyone's reference.

    Each method's text is its own free-running output; its agreement, KL and first divergence are teacher-forced on
    full's tokens (:mod:`kvviz.comparison.metrics`). A method whose free-running tokens equal full's needs no
    teacher-forced decode: it would feed the method exactly the inputs it already saw. A method that fails is reported
    with its error while the others still complete.

    ``batched`` (the default, on every device): one prefill, then every method decodes in one batch, one forward per
    step for all of them (:mod:`kvviz.runtime.batch`); at the step a method first parts from full, its teacher-forced
    twin joins (a copy of its cache fed full's tokens from then on, which its agreement and KL are scored on), and
    each result's ``seconds`` is its fork plus its share of the batch's forwards. ``batched=False``
    decodes the methods one after another after the same prefill: the baseline the tests and the bench compare
    against. Both give the same tokens, ledgers and bytes (tests/test_batched.py). ``reuse_prefix``: the
    prefill reuses the model's prefix cache where the methods' capture allows (editing the end of a long prompt
    re-runs only the tail; see :mod:`kvviz.runtime.prefix`).

    One job submitted to the model's engine (:func:`compare_job`), whose result this waits for.
    """
    return loaded.engine.run(compare_job(loaded, prompt_ids, specs, max_new_tokens, sampling, batched, reuse_prefix),
                             progress)


def compare_job(loaded: LoadedModel, prompt_ids: Sequence[int], specs: Sequence[str], max_new_tokens: int = 64,
                sampling: Sampling | None = None, batched: bool = True, reuse_prefix: bool = True) -> Job[Comparison]:
    """:func:`compare` as a job for the model's engine: the SPECs parsed and the prompt checked here (SpecError,
    PromptError before any model work), then the states the engine advances (:func:`compare_steps`). Every
    configuration's row attends over the prompt at each step: that is the run's size for admission."""
    stacks = reference_first(specs)
    session = PromptSession(loaded, list(prompt_ids), reuse_prefix)
    return Job(functools.partial(compare_steps, session, stacks, max_new_tokens, sampling, batched),
               RunSize(len(prompt_ids) * len(stacks), loaded.device), "compare")


def compare_steps(session: PromptSession, stacks: list[MethodStack], max_new_tokens: int,
                  sampling: Sampling | None, batched: bool, progress: Progress) -> Steps[Comparison]:
    """A comparison's states: the prompt prefilled (in the engine's shared prefill when nothing records it, else on
    its own with the methods' one capture), every method's cache forked and the prefill's quantization diagnosed,
    the rows decoded in the engine's running batch, then scored against full."""
    capture = capture_for(stacks)  # one capture serves every method: forks never re-prefill
    loaded = session.loaded
    progress(0.0, f"prefilling {len(session.prompt_ids):,} prompt tokens")  # seconds on a CPU for a 2K prompt
    if capture is None:  # nothing records the prompt: it may share a forward with other runs' prompts
        (shared,) = yield SharedPrefill([session.prompt_ids], session.reuse_prefix)
        session.adopt(shared)
    else:
        yield Stage.PREFILL
    prefill = session.prefill(capture)
    yield Stage.FORK
    if batched:
        made = fork_rows(session, stacks, progress)
    else:
        made = _compare_sequential(session, stacks, max_new_tokens, sampling, progress)
    quantization = quantization_report([layer.storage.materialize() for layer in prefill.cache.layers], stacks)
    results = made
    if batched:
        group = decode_group(session, made, max_new_tokens, BOTH, sampling, progress)
        yield Decode([group])
        yield Stage.SCORE
        results = group_results(session, made, BOTH)
    return Comparison(loaded.name, loaded.device, len(session.prompt_ids), session.prompt_ids, prefill.seconds,
                      results, quantization)


def reference_first(specs: Sequence[str]) -> list[MethodStack]:
    """The SPECs parsed (a SpecError before any work) with ``full`` first, added if missing: every other method is
    scored against it."""
    stacks = [parse_spec(spec) for spec in specs]
    if not any(s.label == "full" for s in stacks):
        stacks.insert(0, parse_spec("full"))
    return sorted(stacks, key=lambda s: s.label != "full")


def _error_result(label: str, error: BaseException) -> MethodResult:
    message = str(error) if isinstance(error, (SpecError, PromptError)) else f"{type(error).__name__}: {error}"
    return MethodResult(method=label, error=message)


def _score(result: MethodResult, reference_logprobs: list[torch.Tensor], logprobs: list[torch.Tensor]) -> None:
    scores = forced_comparison(reference_logprobs, logprobs)
    result.agreement_with_full, result.first_divergence = scores.agreement, scores.first_divergence
    result.kl_per_step, result.mean_kl = scores.kl_per_step, scores.mean_kl


def fork_rows(session: PromptSession, stacks: list[MethodStack], progress: Progress | None = None) -> list[Row]:
    """Every method's cache forked from the shared prefill (full first: it is the reference); a method that cannot
    fork is a row with its error."""
    first_logits = session.prefill(session._capture).last_logits
    forking = share(progress, 0.0, FORKING)
    rows = []
    for index, stack in enumerate(stacks):
        if forking is not None:
            forking(index / len(stacks), f"{stack.label}: compressing the prompt")
        started = time.perf_counter()
        try:
            rows.append(Row(stack, session.fork(stack), first_logits, seconds=time.perf_counter() - started))
        except ROW_ERRORS as error:
            rows.append(Row(stack, None, first_logits, error=error))
    return rows


# What the rows after full decode (full, first, always runs free and is the reference):
FREE = "free"  # each its own greedy (or sampled) continuation: texts only, nothing scored against full
FORCED = "forced"  # full's tokens from the first step (teacher-forced): agreement and KL, no text of their own
BOTH = "both"  # free-running, and a teacher-forced twin from the step it first parts from full (Compare)
MODES = (FREE, FORCED, BOTH)


def decode_group(session: PromptSession, rows: list[Row], max_new_tokens: int, mode: str,
                 sampling: Sampling | None = None, progress: Progress | None = None) -> DecodeGroup:
    """The rows of one prompt as one run's group for the running batch, decoding as ``mode`` says."""
    full = rows[0] if rows[0].error is None and rows[0].label == "full" else None
    if mode == FORCED and full is not None:
        for row in rows[1:]:
            row.follows = full
    return DecodeGroup(rows, max_new_tokens, session.eos_ids, sampling, keep_logprobs=mode != FREE,
                       progress=share(progress, FORKING, 1.0), reference=full if mode == BOTH else None)


def group_results(session: PromptSession, rows: list[Row], mode: str) -> list[MethodResult]:
    """Each row's result after its group decoded, scored against full's teacher-forced distributions unless
    ``mode`` is FREE. Without a working full, a FORCED row had nothing to follow: every row reports full's error."""
    full = rows[0] if rows[0].label == "full" else None
    if mode == FORCED and full is not None and full.error is not None:
        return [_error_result(row.label, full.error) for row in rows]
    reference_ok = mode != FREE and full is not None and full.error is None
    results = []
    for row in rows:
        failed = row.error or (row.twin.error if row.twin is not None else None)
        if failed is not None:
            results.append(_error_result(row.label, failed))
            continue
        seconds = row.seconds + (row.twin.seconds if row.twin is not None else 0.0)
        result = session.result(row.stack, row.cache, row.trace, seconds)
        if reference_ok:
            _score(result, full.trace.step_logprobs, (row.twin or row).trace.step_logprobs)
        results.append(result)
    return results


def _compare_sequential(session: PromptSession, stacks: list[MethodStack], max_new_tokens: int,
                        sampling: Sampling | None, progress: Progress | None) -> list[MethodResult]:
    """One method after another, each with its own decode (and a second, teacher-forced one when it parts from
    full): the baseline for the batched decode (:func:`decode_group`)."""
    results: list[MethodResult] = []
    reference: MethodResult | None = None
    reference_logprobs: list[torch.Tensor] = []
    for index, stack in enumerate(stacks):
        report = share(progress, index / len(stacks), (index + 1) / len(stacks), f"{stack.label}: ")
        try:
            free_running = 1.0 if reference is None else 0.5  # the second half for a teacher-forced decode
            result, trace = session.run(stack, max_new_tokens, sampling, keep_logprobs=True,
                                        progress=share(report, 0.0, free_running))
            if reference is None and stack.label == "full":
                reference, reference_logprobs = result, trace.step_logprobs
            logprobs = trace.step_logprobs
            if reference is not None and result.token_ids != reference.token_ids:
                _, forced = session.run(stack, max_new_tokens, sampling, forced_tokens=reference.token_ids,
                                        keep_logprobs=True, progress=share(report, 0.5, 1.0, "teacher-forced "))
                logprobs = forced.step_logprobs
            if reference is not None:
                _score(result, reference_logprobs, logprobs)
        except ROW_ERRORS as error:  # one method's crash must not sink the others
            result = _error_result(stack.label, error)
        results.append(result)
    return results
