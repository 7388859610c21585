"""Query-aware eviction versus prefix reuse: can two questions share one compressed preamble?

A prefix cache shares a preamble's KV between prompts only when the cached entries are the same for both. A
query-aware method (SnapKV with the question in its observation window) picks the preamble tokens the question
attends to, so two questions keep different preamble tokens and the compressed prefix cannot be shared. A
query-agnostic compression (kvpress's setting: compress the preamble alone, feed the question afterwards) keeps the
same tokens for every question by construction, so it can.

For each method and mode this measures, per layer, the Jaccard overlap of the preamble tokens kept for question A
and for question B (mean over KV heads), and the quality cost of answering B from the preamble compressed for A,
next to answering B from its own: both teacher-forced on the full cache's answer to B (agreement and KL,
:mod:`kvviz.comparison.metrics`). Both answers start from the same construction, the dense preamble cut to a kept set
with B's tokens fed after it, so the only difference is whose kept set it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvviz.cache.kvcache import KVCache
from kvviz.cache.layer_types import LayerTypes
from kvviz.cache.storage import gather_tokens
from kvviz.comparison.metrics import forced_comparison
from kvviz.comparison.session import PromptSession
from kvviz.methods import MethodStack, parse_spec
from kvviz.runtime.admission import ALONE
from kvviz.runtime.jobs import Job, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.prefill import prefill_with_prefix
from kvviz.runtime.progress import Progress
from kvviz.runtime.replay import decode, eos_token_ids
from kvviz.studies.needle import MODES

DEFAULT_METHODS = ("snapkv:budget=256,window=48", "streaming_llm:sinks=4,window=252,rerotate=0",
                   "kvpress:press=knorm,ratio=0.75")


@dataclass
class SharingRow:
    """One method in one mode: how alike the two questions' kept preambles are, and what sharing costs B."""

    method: str
    mode: str
    jaccard_per_layer: list[float]
    kept_per_head: float  # preamble tokens kept per KV head, mean over layers, heads and the two questions
    agreement_own: float
    mean_kl_own: float
    agreement_shared: float  # answering B from the preamble compressed for A
    mean_kl_shared: float

    @property
    def jaccard(self) -> float:
        return sum(self.jaccard_per_layer) / len(self.jaccard_per_layer)

    @property
    def shareable(self) -> bool:
        """The same preamble entries kept for both questions in every layer and head: one compressed prefix serves
        both."""
        return all(value == 1.0 for value in self.jaccard_per_layer)


@dataclass
class SharingReport:
    preamble_tokens: int
    question_tokens: tuple[int, int]
    max_new_tokens: int
    rows: list[SharingRow] = field(default_factory=list)

    def to_rows(self) -> list[dict]:
        return [{"method": r.method, "mode": r.mode, "jaccard_mean": r.jaccard, "shareable": r.shareable,
                 "kept_per_head": r.kept_per_head, "agreement_own": r.agreement_own, "mean_kl_own": r.mean_kl_own,
                 "agreement_shared": r.agreement_shared, "mean_kl_shared": r.mean_kl_shared} for r in self.rows]

    def json_rows(self) -> list[dict]:
        """:meth:`to_rows` with each row's Jaccard per layer (the CLI's JSON)."""
        return [row | {"jaccard_per_layer": r.jaccard_per_layer} for row, r in zip(self.to_rows(), self.rows,
                                                                                     strict=True)]

    def lines(self) -> list[str]:
        """A header, then per method and mode: Jaccard, shareable or not, and what answering B from A's cache costs."""
        return ["kept preamble tokens, question A vs B (Jaccard, mean over layers; answering B from A's cache):"] + [
            f"  {r.method:<44} {r.mode:<15} Jaccard {r.jaccard:.3f} "
            f"{'shareable' if r.shareable else 'NOT shareable':<13} agreement own {r.agreement_own:.2f} "
            f"shared {r.agreement_shared:.2f}, KL own {r.mean_kl_own:.4f} shared {r.mean_kl_shared:.4f}"
            for r in self.rows]


def kept_preamble(cache: KVCache, preamble_tokens: int) -> list[list[set[int]]]:
    """Per layer and KV head, the preamble positions a compressed cache holds."""
    return [[{int(p) for p in head if p < preamble_tokens} for head in layer.positions[0]] for layer in cache.layers]


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def preamble_cut_to(dense: KVCache, kept: list[list[set[int]]], preamble_tokens: int,
                    layer_types: LayerTypes | None = None) -> KVCache:
    """A plain cache of the dense preamble's entries at ``kept`` positions (absolute positions kept).

    Heads that kept fewer preamble tokens than others (a question token took their place) are topped up with their
    most recent dropped preamble tokens, so every head of a layer holds the same count, as a cache tensor must.
    """
    cache = KVCache(len(dense.layers), layer_types=layer_types)  # a local layer drops what its window passed
    cache.prompt_length = preamble_tokens
    for source, layer, heads in zip(dense.layers, cache.layers, kept, strict=True):
        count = max(len(head) for head in heads)
        rows = []
        for head in heads:
            missing = [p for p in range(preamble_tokens - 1, -1, -1) if p not in head][:count - len(head)]
            rows.append(sorted(head | set(missing)))
        keys, values = source.storage.materialize()
        index = torch.tensor(rows, device=keys.device).unsqueeze(0)
        keys = gather_tokens(keys[:, :, :preamble_tokens], index)
        values = gather_tokens(values[:, :, :preamble_tokens], index)
        layer.lazy_initialization(keys, values)
        layer.storage.append(keys, values)
        layer.positions, layer.rotary = index.clone(), index.clone()
    return cache


def compare_sharing(loaded: LoadedModel, preamble_ids: list[int], question_a: list[int], question_b: list[int],
                    specs: list[str] | tuple[str, ...] = DEFAULT_METHODS, max_new_tokens: int = 16,
                    progress: Progress | None = None) -> SharingReport:
    """Compress the preamble for questions A and B with every method in both modes; see the module docstring. One
    job on the model's engine (:func:`sharing_job`), whose result this waits for."""
    return loaded.engine.run(sharing_job(loaded, preamble_ids, question_a, question_b, specs, max_new_tokens),
                             progress)


def sharing_job(loaded: LoadedModel, preamble_ids: list[int], question_a: list[int], question_b: list[int],
                specs: list[str] | tuple[str, ...] = DEFAULT_METHODS, max_new_tokens: int = 16) -> Job[SharingReport]:
    """:func:`compare_sharing` as a job: the methods checked here, then one method and mode per step, the model
    given back between them."""
    stacks = [parse_spec(spec) for spec in specs]
    for stack in stacks:
        if stack.eviction is None:
            raise ValueError(f"{stack.label} evicts nothing: prefix sharing compares eviction methods")
    return Job(functools.partial(_sharing_steps, loaded, list(preamble_ids), list(question_a), list(question_b),
                                 stacks, max_new_tokens), ALONE, "prefix_sharing")


def _sharing_steps(loaded: LoadedModel, preamble_ids: list[int], question_a: list[int], question_b: list[int],
                   stacks: list[MethodStack], max_new_tokens: int, progress: Progress) -> Steps[SharingReport]:
    yield Stage.MEASURE
    preamble_tokens = len(preamble_ids)
    report = SharingReport(preamble_tokens, (len(question_a), len(question_b)), max_new_tokens)
    eos = eos_token_ids(loaded.model, loaded.tokenizer)
    steps = len(stacks) * len(MODES) + 1
    _report(progress, 0, steps, "full cache: reference answer to B")
    _, reference = PromptSession(loaded, preamble_ids + question_b, reuse_prefix=True).run(
        "full", max_new_tokens, keep_logprobs=True)
    dense = prefill_with_prefix(loaded.model, loaded.device, preamble_ids, loaded.prefix_cache).cache

    def answer_b(kept: list[list[set[int]]]):
        cache = preamble_cut_to(dense, kept, preamble_tokens, loaded.layer_types)
        unused = torch.zeros(1)  # the question's last token gives the first logits
        trace = decode(loaded.model, cache, unused, max_new_tokens, loaded.device, eos,
                       forced_tokens=reference.token_ids, keep_logprobs=True, suffix_tokens=question_b)
        return forced_comparison(reference.step_logprobs, trace.step_logprobs)

    for index, stack in enumerate(stacks):
        for offset, mode in enumerate(MODES):
            yield Turn(ALONE)
            _report(progress, 1 + index * len(MODES) + offset, steps, f"{stack.label}, {mode.replace('_', '-')}")
            if mode == "query_aware":
                kept_a = kept_preamble(PromptSession(loaded, preamble_ids + question_a, reuse_prefix=True)
                                       .fork(stack, ledger=False), preamble_tokens)
                kept_b = kept_preamble(PromptSession(loaded, preamble_ids + question_b, reuse_prefix=True)
                                       .fork(stack, ledger=False), preamble_tokens)
            else:  # the preamble compressed alone serves every question
                kept_a = kept_b = kept_preamble(PromptSession(loaded, preamble_ids, reuse_prefix=True)
                                                .fork(stack, ledger=False), preamble_tokens)
            own = answer_b(kept_b)
            shared = own if kept_a == kept_b else answer_b(kept_a)
            overlap = [sum(jaccard(a, b) for a, b in zip(la, lb, strict=True)) / len(la)
                       for la, lb in zip(kept_a, kept_b, strict=True)]
            sizes = [len(head) for kept in (kept_a, kept_b) for layer in kept for head in layer]
            report.rows.append(SharingRow(stack.label, mode, overlap, sum(sizes) / len(sizes), own.agreement,
                                          own.mean_kl or 0.0, shared.agreement, shared.mean_kl or 0.0))
    _report(progress, steps, steps, "done")
    return report


def _report(progress: Progress | None, done: int, total: int, message: str) -> None:
    if progress is not None:
        progress(done / total, message)
