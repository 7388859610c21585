"""Many caches, one forward: the configurations of a comparison decode together, one model call per step.

Each row is an ordinary :class:`~kvviz.cache.kvcache.KVCache` (its own method stack, storage, kept entries, rotary
positions and ledger) doing exactly what it does alone. :class:`BatchCache` is the transformers ``Cache`` the model sees
for a forward over N rows of one token each: each layer's ``update`` splits the new K/V by row, lets that row's
``KVLayer.update`` append and evict as it would alone, and left-pads the rows' K/V to one length. transformers sizes
its mask before the update runs (and eviction inside the update changes each row's length), so kvviz's attention
function masks the padding itself (:func:`kvviz.cache.capture.padded_keys`), from the lengths each row reported. Rows
whose method scores attention at decode time (H2O, TOVA) receive their own row's probabilities with the padding cut off.

A row that fails inside its own update or selection is reported and leaves the batch; the others go on, because
nothing of one row mixes with another's (the linear layers work row by row, attention is masked per row).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvviz.cache.capture import listening, padded_keys, take_padded_keys
from kvviz.cache.kvcache import FirstUpdateLayer, KVCache
from kvviz.cache.spec import MethodStack, SpecError
from kvviz.runtime.faults import is_out_of_memory
from kvviz.runtime.replay import DecodeTrace, Progress, Sampling

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
    generator: torch.Generator | None = None
    done: bool = False
    error: BaseException | None = None
    seconds: float = 0.0
    twin: Row | None = None

    @property
    def label(self) -> str:
        return self.stack.label


class BatchLayer(FirstUpdateLayer):
    """One decoder layer across the rows: each row's own layer does the work; this one pads and stacks."""

    is_sliding = False

    def __init__(self, batch: BatchCache, layer_idx: int):
        super().__init__()
        self.batch = batch
        self.layer_idx = layer_idx
        self.lengths: list[int] = []  # each row's key count in the forward under way
        self.mask: torch.Tensor | None = None  # [N, 1, 1, L], True on real keys; None when no row is padded


    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values, head_padding = [], [], []
        for index, row in enumerate(self.batch.rows):
            new_keys, new_values = key_states[index:index + 1], value_states[index:index + 1]
            if index not in self.batch.failures:
                try:
                    new_keys, new_values = row.layers[self.layer_idx].update(new_keys, new_values, cache_kwargs)
                except ROW_ERRORS as error:  # the row leaves after this forward; its new entries stand in
                    self.batch.failures[index] = error
            keys.append(new_keys)
            values.append(new_values)
            head_padding.append(take_padded_keys(self.layer_idx))  # a row whose heads keep unequal counts (adakv)
        self.lengths = [k.shape[2] for k in keys]
        longest = max(self.lengths)
        if min(self.lengths) == longest and all(p is None for p in head_padding):
            self.mask = None
            return torch.cat(keys), torch.cat(values)
        # keys and values may differ in width (DeepSeek's MLA: 24-channel keys with decoupled RoPE, 16-channel values)
        padded_keys_ = key_states.new_zeros(len(keys), keys[0].shape[1], longest, keys[0].shape[3])
        padded_values = value_states.new_zeros(len(values), values[0].shape[1], longest, values[0].shape[3])
        for index, (k, v) in enumerate(zip(keys, values, strict=True)):
            padded_keys_[index, :, longest - k.shape[2]:] = k[0]
            padded_values[index, :, longest - v.shape[2]:] = v[0]
        starts = torch.tensor([longest - n for n in self.lengths], device=key_states.device)
        self.mask = (torch.arange(longest, device=key_states.device) >= starts[:, None]).view(len(keys), 1, 1, longest)
        if any(p is not None for p in head_padding):  # per KV head: [N, H_kv, 1, L]
            self.mask = self.mask.expand(-1, keys[0].shape[1], -1, -1).clone()
            for index, padding in enumerate(head_padding):
                if padding is not None:
                    self.mask[index, :, 0, longest - padding.shape[-1]:] &= ~padding[0].to(self.mask.device)
        return padded_keys_, padded_values

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return max(row.layers[self.layer_idx].get_seq_length() for row in self.batch.rows) + 1, 0

    def get_seq_length(self) -> int:
        return max(row.layers[self.layer_idx].get_seq_length() for row in self.batch.rows)

    def get_max_cache_shape(self) -> int:
        return -1


class BatchCache(Cache):
    """The rows' caches as one transformers Cache for a forward of one token per row.

    It is also the padding source for kvviz's attention (:meth:`key_mask`) and the attention listener of the rows
    whose method scores attention at decode time (each gets its own row of probabilities, unpadded).
    """

    def __init__(self, rows: list[KVCache]):
        self.rows = rows
        self.failures: dict[int, BaseException] = {}
        super().__init__(layers=[BatchLayer(self, i) for i in range(len(rows[0].layers))])

    def key_mask(self, layer_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].mask

    def wants(self, layer_idx: int) -> bool:
        return any(row.wants(layer_idx) for i, row in enumerate(self.rows) if i not in self.failures)

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None:
        lengths, width = self.layers[layer_idx].lengths, probs.shape[-1]
        for index, row in enumerate(self.rows):
            if index in self.failures or not row.wants(layer_idx):
                continue
            try:
                row.observe(layer_idx, probs[index:index + 1, ..., width - lengths[index]:], query_start, query_total)
            except ROW_ERRORS as error:
                self.failures[index] = error


def forward_rows(model: torch.nn.Module, caches: list[KVCache], tokens: list[int], positions: list[int],
                 step: int, device: str) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """Feed decode step ``step``'s token to every row (row i's ``tokens[i]`` at absolute position ``positions[i]``);
    return the next-token logits [N, vocab] and the rows that failed (their logits are meaningless)."""
    batch = BatchCache(caches)
    rotary = []
    for index, (cache, position) in enumerate(zip(caches, positions, strict=True)):
        try:
            position_ids, _ = cache.begin_forward(torch.tensor([position]), step)
        except ROW_ERRORS as error:
            batch.failures[index] = error
            position_ids = torch.tensor([[position]])
        rotary.append(position_ids)
    stored = max(cache.get_seq_length() for cache in caches)
    with listening(batch), padded_keys(batch):
        output = model(
            input_ids=torch.tensor([[t] for t in tokens], device=device),
            past_key_values=batch,
            position_ids=torch.cat(rotary).to(device),
            cache_position=torch.tensor([stored], device=device),
            use_cache=True,
            logits_to_keep=1,
        )
    return output.logits[:, -1], batch.failures


def _copy_cache(cache: KVCache) -> KVCache:
    """An independent copy of a row's cache (its stored entries, positions and methods' state), for a teacher-forced
    twin; the method objects and the key rotator are shared, as they hold settings only. The ledger is dropped:
    a twin only reports its distributions."""
    shared = [cache.stack, *cache.stack.members(), cache.rotate_keys, cache.ledger]
    twin = copy.deepcopy(cache, memo={id(item): item for item in shared if item is not None})
    twin.ledger = None
    return twin


def decode_together(
    model: torch.nn.Module,
    rows: list[Row],
    max_new_tokens: int,
    device: str,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    keep_logprobs: bool = False,
    progress: Progress | None = None,
    reference: Row | None = None,
) -> list[Row]:
    """Decode every row together (one forward per step for all of them); rows leave as they stop or fail.

    Each row does what :func:`kvviz.runtime.replay.decode` does alone: same tokens (greedy, or each row its own seeded
    sampler), same per-step bytes, same ledger. With a ``reference`` (full), a free-running row that first chooses a
    different token gets a teacher-forced twin, fed the reference's tokens from then on: until that step the row saw
    exactly the reference's inputs, so a copy of its cache made before the step's token is fed holds what a
    teacher-forced run from the start would hold, and the twin inherits the row's log-probabilities so far. Returns
    the rows followed by the twins.
    """
    sampling = sampling or Sampling()
    for row in rows:
        if row.cache is None:
            continue
        row.position = row.cache.prompt_length
        row.generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
        row.trace.kv_bytes_per_step.append(row.cache.nbytes().total)  # step 0: after prefill compression
    everyone = list(rows)
    active = [row for row in rows if row.cache is not None and row.error is None]
    with torch.inference_mode():
        for step in range(1, max_new_tokens + 1):
            for row in active:  # a leader comes before its followers, so they read this step's token
                if keep_logprobs:
                    row.trace.step_logprobs.append(torch.log_softmax(row.logits.float(), dim=-1).cpu())
                leader = row.follows
                token = leader.trace.token_ids[-1] if leader is not None else sampling.choose(row.logits, row.generator)
                row.trace.token_ids.append(token)
                row.done = leader.done if leader is not None else step == max_new_tokens or token in eos_ids
            if reference is not None and reference.error is None:
                twins = [_twin(row, reference) for row in active
                         if row is not reference and row.follows is None and row.twin is None
                         and row.trace.token_ids[-1] != reference.trace.token_ids[-1]]
                everyone += twins
                active += [twin for twin in twins if not twin.done]
            feeding = [row for row in active if not row.done]
            if progress is not None:
                progress(step / max_new_tokens, f"token {step}/{max_new_tokens}, {len(feeding)} rows together")
            if not feeding:
                break
            _feed(model, feeding, step, device)
            active = [row for row in feeding if row.error is None]
            if reference is not None and reference.error is not None:  # twins follow full: they cannot go on
                active = [row for row in active if row.follows is None]
    return everyone


def _twin(row: Row, reference: Row) -> Row:
    """The teacher-forced twin of ``row``, which just chose differently from ``reference`` at this step."""
    twin = Row(row.stack, None, row.logits, follows=reference, position=row.position, done=reference.done)
    twin.trace.token_ids = list(reference.trace.token_ids)
    twin.trace.step_logprobs = list(row.trace.step_logprobs)
    row.twin = twin
    if not twin.done:  # when the reference stops here, the twin already has every distribution it needs
        twin.cache = _copy_cache(row.cache)
    return twin


def _feed(model: torch.nn.Module, rows: list[Row], step: int, device: str) -> None:
    """One forward for ``rows``, each fed the token it chose at ``step``; failed rows are marked and leave."""
    started = time.perf_counter()
    try:
        logits, failures = forward_rows(model, [row.cache for row in rows], [row.trace.token_ids[-1] for row in rows],
                                        [row.position for row in rows], step, device)
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
