"""Many caches, one forward: the configurations of a comparison (and the runs of different users) decode together.

Each row is an ordinary :class:`~kvviz.cache.kvcache.KVCache` (its own method stack, storage, kept entries, rotary
positions and ledger) doing exactly what it does alone. :class:`BatchCache` is the transformers ``Cache`` the model sees
for a forward over N rows of one token each: each layer's ``update`` splits the new K/V by row and lets that row's
``KVLayer.update`` append and evict as it would alone. Nothing is padded: the batch is passed with the model call as
its attention's key source (:class:`kvviz.cache.attention.KeySource`), so the linear layers run over all rows at
once and attention runs per row over that row's own keys (a row whose method scores attention at decode time, H2O or
TOVA, gets its own probabilities; the others stay on SDPA).

A row that fails inside its own update or selection is reported and leaves the batch; the others go on, because
nothing of one row mixes with another's. :class:`DecodeGroup` is one run's rows: a comparison's configurations and
their teacher-forced *twins* (a twin is a copy of a configuration's cache, made at the step where that configuration
first chooses another token than full, then fed full's tokens, so that its distributions can be scored against
full's: agreement and KL are teacher-forced). :func:`step_groups` feeds any number of groups in one forward, which is
how the engine (:mod:`kvviz.runtime.engine`) lets runs of different users decode together.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvviz.cache.attention import KeyPart
from kvviz.cache.kvcache import FirstUpdateLayer, KVCache
from kvviz.cache.spec import MethodStack, SpecError
from kvviz.runtime.faults import is_out_of_memory
from kvviz.runtime.progress import Progress
from kvviz.runtime.replay import DecodeTrace, Sampling

ROW_ERRORS = (SpecError, RuntimeError, ValueError, IndexError)  # what fails one row without failing the others


@dataclass
class Row:
    """One configuration in the batch: its cache, what it produced, and where its next token comes from.

    ``follows``: a teacher-forced row is fed the tokens that row chooses (full's), in the same step.
    ``twin``: the teacher-forced copy spawned when this free-running row first chose differently from the reference.
    ``seconds``: this row's share of the batch's decode time (each forward split evenly over the rows it fed).
    """

    stack: MethodStack
    cache: KVCache | None
    logits: torch.Tensor
    follows: Row | None = None
    trace: DecodeTrace = field(default_factory=DecodeTrace)
    position: int = 0  # absolute position of the next token fed
    step: int = 0  # the decode step of the token fed next
    generator: torch.Generator | None = None
    done: bool = False
    error: BaseException | None = None
    seconds: float = 0.0
    twin: Row | None = None

    @property
    def label(self) -> str:
        return self.stack.label


@dataclass
class RowListener:
    """A row's cache listening to its own attention inside a batch; a selection that fails fails only that row."""

    batch: BatchCache
    index: int

    def wants(self, layer_idx: int) -> bool:
        return self.index not in self.batch.failures

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None:
        if self.index in self.batch.failures:
            return
        try:
            self.batch.rows[self.index].observe(layer_idx, probs, query_start, query_total)
        except ROW_ERRORS as error:
            self.batch.failures[self.index] = error


class BatchLayer(FirstUpdateLayer):
    """One decoder layer across the rows: each row's own layer does the work; this one keeps what each returned."""

    is_sliding = False

    def __init__(self, batch: BatchCache, layer_idx: int):
        super().__init__()
        self.batch = batch
        self.layer_idx = layer_idx
        self.parts: list[KeyPart] = []  # each row's keys in the forward under way

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        """Let every row store its new entry; what attention reads comes from :meth:`BatchCache.key_parts`, so the
        new K/V are returned as they came (no row is stacked or padded to another's length)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.parts = []
        counts = self.batch.query_counts
        for index, row in enumerate(self.batch.rows):
            rows = slice(index, index + 1)
            queries = None if counts is None else counts[index]
            keys, values, hidden, listener = key_states[rows, :, :queries], value_states[rows, :, :queries], None, None
            if index not in self.batch.failures:
                layer = row.layers[self.layer_idx]
                try:
                    keys, values = layer.update(keys, values, cache_kwargs)
                    hidden = layer.hidden
                    listener = RowListener(self.batch, index) if row.wants(self.layer_idx) else None
                except ROW_ERRORS as error:  # the row leaves after this forward; its new entry stands in
                    self.batch.failures[index] = error
            self.parts.append(KeyPart(rows, keys, values, hidden, listener, queries))
        return key_states, value_states

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return max(row.layers[self.layer_idx].get_seq_length() for row in self.batch.rows)

    def get_max_cache_shape(self) -> int:
        return -1


class BatchCache(Cache):
    """The rows' caches as one transformers Cache for a forward of one token per row (or of each row's prompt,
    right-padded to the longest: ``query_counts`` holds each row's own count of query positions), and the key source
    of kvviz's attention for that forward (each row attends over its own keys)."""

    def __init__(self, rows: list[KVCache], query_counts: list[int] | None = None):
        self.rows = rows
        self.query_counts = query_counts
        self.failures: dict[int, BaseException] = {}
        super().__init__(layers=[BatchLayer(self, i) for i in range(len(rows[0].layers))])

    def key_parts(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> list[KeyPart]:
        return self.layers[layer_idx].parts


def forward_rows(model: torch.nn.Module, caches: list[KVCache], tokens: list[int], positions: list[int],
                 steps: list[int], device: str) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """Feed every row its token (row i's ``tokens[i]`` at absolute position ``positions[i]``, decode step
    ``steps[i]``); return the next-token logits [N, vocab] and the rows that failed (their logits are meaningless)."""
    batch = BatchCache(caches)
    rotary = []
    for index, (cache, position, step) in enumerate(zip(caches, positions, steps, strict=True)):
        try:
            position_ids, _ = cache.begin_forward(torch.tensor([position]), step)
        except ROW_ERRORS as error:
            batch.failures[index] = error
            position_ids = torch.tensor([[position]])
        rotary.append(position_ids)
    stored = max(cache.get_seq_length() for cache in caches)
    output = model(
        input_ids=torch.tensor([[t] for t in tokens], device=device),
        past_key_values=batch,
        key_source=batch,
        position_ids=torch.cat(rotary).to(device),
        cache_position=torch.tensor([stored], device=device),
        use_cache=True,
        logits_to_keep=1,
    )
    return output.logits[:, -1], batch.failures


def prefill_rows(model: torch.nn.Module, caches: list[KVCache], prompts: list[list[int]], starts: list[int],
                 device: str) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """Prompts of different runs in one forward: row i's tokens ``prompts[i]`` at absolute positions from ``starts[i]``
    into ``caches[i]`` (dense, perhaps seeded with a reused prefix), each padded at its end to the longest. Padding
    comes after a row's tokens, which never attend to it, and is never stored. Returns each row's last-token
    logits [N, vocab] and the rows that failed."""
    width = max(len(tokens) for tokens in prompts)
    batch = BatchCache(caches, [len(tokens) for tokens in prompts])
    rotary = []
    for cache, tokens, start in zip(caches, prompts, starts, strict=True):
        position_ids, _ = cache.begin_forward(torch.arange(start, start + len(tokens)), 0)
        padding = int(position_ids[0, -1]) + 1 + torch.arange(width - len(tokens))
        rotary.append(torch.cat([position_ids[0], padding]))
    lasts = sorted({len(tokens) - 1 for tokens in prompts})  # the lm head runs on these positions only
    stored = max(cache.get_seq_length() for cache in caches)
    output = model(
        input_ids=torch.tensor([tokens + tokens[-1:] * (width - len(tokens)) for tokens in prompts], device=device),
        past_key_values=batch,
        key_source=batch,
        position_ids=torch.stack(rotary).to(device),
        cache_position=torch.arange(stored, stored + width, device=device),
        use_cache=True,
        logits_to_keep=torch.tensor(lasts, device=device),
    )
    columns = torch.tensor([lasts.index(len(tokens) - 1) for tokens in prompts], device=device)
    return output.logits[torch.arange(len(prompts), device=device), columns], batch.failures


def _copy_cache(cache: KVCache) -> KVCache:
    """An independent copy of a row's cache (its stored entries, positions and methods' state), for a teacher-forced
    twin; the method objects and the key rotator are shared, as they hold settings only. The ledger is dropped:
    a twin only reports its distributions."""
    shared = [cache.stack, *cache.stack.members(), cache.rotate_keys, cache.ledger]
    twin = copy.deepcopy(cache, memo={id(item): item for item in shared if item is not None})
    twin.ledger = None
    return twin


class DecodeGroup:
    """One run's rows decoding together: what :func:`kvviz.runtime.replay.decode` does alone, for every row.

    Same tokens (greedy, or each row its own seeded sampler), same per-step bytes, same ledger. With a ``reference``
    (full), a free-running row that first chooses a different token gets a teacher-forced twin, fed the reference's
    tokens from then on: until that step the row saw exactly the reference's inputs, so a copy of its cache made
    before the step's token is fed holds what a teacher-forced run from the start would hold, and the twin inherits
    the row's log-probabilities so far. A step is :meth:`choose` (tokens, twins, progress), one forward shared with
    other groups (:func:`step_groups`), then :meth:`after_forward`. ``error`` set by a step fails this group only.
    """

    def __init__(self, rows: list[Row], max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                 keep_logprobs: bool = False, progress: Progress | None = None, reference: Row | None = None):
        self.sampling = sampling or Sampling()
        self.max_new_tokens, self.eos_ids, self.keep_logprobs = max_new_tokens, eos_ids, keep_logprobs
        self.progress, self.reference = progress, reference
        for row in rows:
            if row.cache is None:
                continue
            row.position = row.cache.prompt_length
            row.generator = (torch.Generator().manual_seed(self.sampling.seed) if self.sampling.temperature > 0
                             else None)
            row.trace.kv_bytes_per_step.append(row.cache.nbytes().total)  # step 0: after prefill compression
        self.everyone = list(rows)  # the rows, then the twins as they join
        self.active = [row for row in rows if row.cache is not None and row.error is None]
        self.feeding: list[Row] = []
        self.step = 0
        self.error: BaseException | None = None
        self._rows_done = False  # set once a step leaves nothing to feed

    @property
    def finished(self) -> bool:
        return self.error is not None or self._rows_done

    def choose(self) -> list[Row]:
        """Choose every active row's next token; return the rows to feed it (none: the group is done)."""
        self.step += 1
        step, reference = self.step, self.reference
        for row in self.active:  # a leader comes before its followers, so they read this step's token
            if self.keep_logprobs:
                row.trace.step_logprobs.append(torch.log_softmax(row.logits.float(), dim=-1).cpu())
            leader = row.follows
            token = leader.trace.token_ids[-1] if leader is not None else self.sampling.choose(row.logits,
                                                                                                 row.generator)
            row.trace.token_ids.append(token)
            row.done = leader.done if leader is not None else step == self.max_new_tokens or token in self.eos_ids
        if reference is not None and reference.error is None:
            twins = [_twin(row, reference) for row in self.active
                     if row is not reference and row.follows is None and row.twin is None
                     and row.trace.token_ids[-1] != reference.trace.token_ids[-1]]
            self.everyone += twins
            self.active += [twin for twin in twins if not twin.done]
        self.feeding = [row for row in self.active if not row.done]
        for row in self.feeding:
            row.step = step
        if self.progress is not None:
            self.progress(min(1.0, step / self.max_new_tokens),
                          f"token {step}/{self.max_new_tokens}, {len(self.feeding)} rows together")
        self._rows_done = not self.feeding
        return self.feeding

    def after_forward(self) -> None:
        """After the forward: failed rows left; twins cannot go on once the reference they follow failed."""
        self.active = [row for row in self.feeding if row.error is None]
        if self.reference is not None and self.reference.error is not None:
            self.active = [row for row in self.active if row.follows is None]
        if not self.active:
            self.feeding, self._rows_done = [], True


def _twin(row: Row, reference: Row) -> Row:
    """The teacher-forced twin of ``row``, which just chose differently from ``reference`` at this step."""
    twin = Row(row.stack, None, row.logits, follows=reference, position=row.position, done=reference.done)
    twin.trace.token_ids = list(reference.trace.token_ids)
    twin.trace.step_logprobs = list(row.trace.step_logprobs)
    row.twin = twin
    if not twin.done:  # when the reference stops here, the twin already has every distribution it needs
        twin.cache = _copy_cache(row.cache)
    return twin


def step_groups(model: torch.nn.Module, groups: list[DecodeGroup], device: str) -> None:
    """One decode step of every group in one forward. A group whose step fails (its progress report raised) gets
    ``error`` and feeds nothing; the others go on."""
    feeding: list[Row] = []
    for group in groups:
        try:
            feeding += group.choose()
        except Exception as error:  # noqa: BLE001 - whatever stops one run must not stop the others
            group.error, group.feeding = error, []
    with torch.inference_mode():
        _feed(model, feeding, device)
    for group in groups:
        if group.error is None:
            group.after_forward()


def _feed(model: torch.nn.Module, rows: list[Row], device: str) -> None:
    """One forward for ``rows``, each fed the token it chose; failed rows are marked and leave."""
    if not rows:
        return
    started = time.perf_counter()
    try:
        logits, failures = forward_rows(model, [row.cache for row in rows], [row.trace.token_ids[-1] for row in rows],
                                        [row.position for row in rows], [row.step for row in rows], device)
    except ROW_ERRORS as error:
        if is_out_of_memory(error):
            raise
        logits, failures = None, dict.fromkeys(range(len(rows)), error)
    share = (time.perf_counter() - started) / len(rows)
    for index, row in enumerate(rows):
        row.seconds += share
        if index in failures:
            row.error, row.done = failures[index], True
            continue
        row.logits = logits[index]
        row.position += 1
        if row.follows is None:
            row.trace.kv_bytes_per_step.append(row.cache.nbytes().total)
