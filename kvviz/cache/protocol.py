"""The protocols the cache calls. Eviction methods choose which entries stay; quantization methods decide how
they are stored; architecture methods change what is cached per token. All see tensors only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch

from kvviz.cache.capture import CaptureConfig
from kvviz.cache.spec import Budget, Method, MethodStack, Sizing, SpecError
from kvviz.cache.storage import KeptRanges


@dataclass
class LayerView:
    """What an eviction method sees of one layer when it decides.

    positions: [B, H_kv, T] absolute token positions of the stored entries (per KV head: heads may differ).
    keys, values: [B, H_kv, T, D] stored entries as attention reads them, read from ``entries`` on first use (a
        positional policy never reads them, which lets the cache fuse an append with the eviction that follows).
    attention: the latest queries' probabilities over these entries, [B, H_q, q, T], for methods that score by
        attention at decode time; None otherwise.
    prompt_length: tokens in the prompt; step: 0 during prefill compression, s >= 1 at decode step s.
    state: the method's own per-layer state (from ``new_state``); layers: the model's layer count.
    """

    layer_idx: int
    layers: int
    positions: torch.Tensor
    entries: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    prompt_length: int
    step: int
    attention: torch.Tensor | None = None
    state: Any = None

    @property
    def keys(self) -> torch.Tensor:
        return self.entries()[0]

    @property
    def values(self) -> torch.Tensor:
        return self.entries()[1]


class Decode(Enum):
    """When the cache calls :meth:`EvictionMethod.select` at each decode step.

    AFTER_APPEND: right after the new entries are appended, before attention, so attention never sees more than the
    budget. AFTER_ATTENTION: after attention, with the new queries' probabilities (H2O, TOVA); the cache holds one
    token over budget while attending. NEVER: the prompt is compressed once and every token that arrives is kept
    (SnapKV, kvpress presses), so a token-by-token stream (streaming perplexity) never compresses.
    """

    AFTER_APPEND = "after append"
    AFTER_ATTENTION = "after attention"
    NEVER = "never"


@dataclass(frozen=True)
class Schedule:
    """When an eviction method's selections run and what the prompt's forward must record for them: the one
    declaration the cache (``decode``), the session (``own_prefill``) and the prefill capture (:attr:`capture`) read.

    ``own_prefill``: the method runs the prompt itself (``run_prefill(session)``: kvpress native) instead of forking
    the shared prefill, and leaves what it found in ``report`` (carried into MethodResult.native_report).
    ``windows``: observation windows whose attention sums :meth:`EvictionMethod.prefill_select` reads (SnapKV, TOVA).
    ``prefill_attention``: it reads the prefill's attention per key over every query (H2O's initial scores).
    ``layer_inputs``: it reads each attention module's prefill input (hidden states and rotary embeddings, in
    ``AttentionStats.layer_inputs``), as kvpress scorers do.
    """

    decode: Decode = Decode.AFTER_APPEND
    own_prefill: bool = False
    windows: tuple[int, ...] = ()
    prefill_attention: bool = False
    layer_inputs: bool = False

    @property
    def capture(self) -> CaptureConfig | None:
        """What the shared prefill records for this method (None: nothing). A comparison's needs are united
        (:meth:`CaptureConfig.uniting`) so that one prefill serves every method."""
        if not (self.windows or self.prefill_attention or self.layer_inputs):
            return None
        return CaptureConfig(windows=self.windows, layer_inputs=self.layer_inputs, all_queries=self.prefill_attention)


class OnLocal(Enum):
    """What an eviction method does on a local (sliding-window) layer, which holds at most its window whatever the
    method does (:mod:`kvviz.cache.layer_types`).

    GLOBAL_ONLY: the method evicts on global layers only; a local layer holds its window as the model does (the
    method's scores and budget are about long-range memory, which local layers do not have).
    WITHIN_WINDOW: the method also selects on local layers, over the entries the layer holds (its window), so its
    budget is counted over what each layer really holds: a positional policy narrower than the window narrows it.
    """

    GLOBAL_ONLY = "global layers only; local layers keep their window"
    WITHIN_WINDOW = "every layer, over what it holds (a local layer: at most its window)"


class EvictionMethod(Method):
    """Decides which cached entries each layer keeps.

    ``schedule``: when its selections run and what they read from the prefill (:class:`Schedule`); a class
    attribute, or an instance's own when it depends on the parameters (SnapKV's window).
    ``rerotate``: cached keys take their positions inside the cache (StreamingLLM's position shift); such a method
    keeps the same entries in every head, so one set of rotary positions serves them all.
    ``on_local_layers``: what it does on a local (sliding-window) layer (:class:`OnLocal`).
    """

    kind = "eviction"
    schedule: Schedule = Schedule()
    on_local_layers: ClassVar[OnLocal] = OnLocal.GLOBAL_ONLY
    stacks_with_architecture: ClassVar[bool] = True  # False: refused next to merge_heads / lowrank, with the reason
    why_not_with_architecture: ClassVar[str] = ""

    @property
    def rerotate(self) -> bool:
        return False

    def new_state(self, layer_idx: int) -> Any:
        return None

    def prefill_select(self, view: LayerView, stats: Any) -> torch.Tensor | KeptRanges | None:
        """After the prompt's forward: entries to keep as :meth:`select` returns them, or None to keep all.

        ``stats`` is the prefill's :class:`kvviz.cache.stats.AttentionStats` (what the schedule's capture asked for).
        """
        return self.select(view)

    def prefill_blocked(self, layer_idx: int) -> torch.Tensor | None:
        """After :meth:`prefill_select`: entries [B, H_kv, T] (True) the layer holds but never attends, so heads that
        keep different counts share one length (kvpress's head-wise presses); None for none."""
        return None

    def select(self, view: LayerView) -> torch.Tensor | KeptRanges | None:
        """During decoding, when the schedule says (:class:`Decode`): indices [B, H_kv, n] (ascending) of entries to
        keep, or :class:`KeptRanges` when every head keeps the same ranges (cheaper to apply), or None to keep all."""
        return None

    def budget_for(self, prompt_length: int) -> int | None:
        """Tokens kept per head at steady state, for the memory formula; None when unbounded."""
        return None

    def layer_budget_for(self, prompt_length: int, layer_idx: int, layers: int) -> int | None:
        """Tokens kept per head in layer ``layer_idx`` of ``layers`` at steady state: :meth:`budget_for` unless
        the method spreads its budget over layers (pyramidkv, per_layer). A local layer's window caps it further
        (:meth:`held_budget`)."""
        return self.budget_for(prompt_length)

    def held_budget(self, prompt_length: int, layer_idx: int, layers: int, window: int | None) -> int | None:
        """Tokens a layer holds per head at steady state, its window included: a local layer (``window`` set) holds
        at most ``window - 1``, and under GLOBAL_ONLY exactly what its window holds; None when unbounded."""
        if window is None:
            return self.layer_budget_for(prompt_length, layer_idx, layers)
        if self.on_local_layers is OnLocal.GLOBAL_ONLY:
            return window - 1
        budget = self.layer_budget_for(prompt_length, layer_idx, layers)
        return window - 1 if budget is None else min(budget, window - 1)

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> EvictionMethod | None:
        """This method set to keep about ``tokens`` entries per head of a ``prompt_length``-token prompt (for sweeps
        and page defaults): ``tokens`` split over its Budget parameters. None when it cannot be sized that way."""
        budgets = [p.name for p in cls.params if p.type is Budget]
        if not budgets:
            return None
        shares = [tokens // len(budgets)] * len(budgets)
        shares[-1] += tokens - sum(shares)
        return cls(**{name: max(1, share) for name, share in zip(budgets, shares, strict=True)})

    @classmethod
    def swept_params(cls) -> tuple[str, ...]:
        """What :meth:`at_budget` sets: the parameters that differ between two budgets of one long prompt."""
        small, large = cls.at_budget(256, SWEEP_PROBE_LENGTH), cls.at_budget(1024, SWEEP_PROBE_LENGTH)
        if small is None or large is None:
            return ()
        return tuple(name for name, value in large.values().items() if small.values().get(name) != value)

    @classmethod
    def sweep_points(cls, shares: Sequence[float], sizing: Sizing,
                     fixed: dict[str, Any]) -> list[tuple[float, Method]]:
        """Keep each share of the prompt's tokens (through :meth:`at_budget`), with ``fixed`` values on top."""
        points = []
        for share in shares:
            sized = cls.at_budget(Budget(share, True).tokens(sizing.prompt_length), sizing.prompt_length)
            if sized is None:
                return []
            try:
                points.append((share, cls(**(sized.changed_values() | fixed))))
            except SpecError:
                continue  # a fixed value this budget cannot hold (a window wider than the budget)
        return points

    def check_context(self, prompt_length: int) -> None:
        """Raise SpecError when the parameters cannot work on a prompt of this length."""


SWEEP_PROBE_LENGTH = 4096  # a prompt long enough that sizing any eviction method to a share of it needs no clamping



class ScoringEviction(EvictionMethod):
    """An eviction method that is its score: the base applies the budget and keeps the top entries per head.

    A subclass gives :meth:`prefill_scores` (and :meth:`decode_scores` unless its schedule says ``Decode.NEVER``);
    when the budget covers every entry nothing is scored, as kvpress's ``ScorerPress`` does.
    """

    def keep_count(self, view: LayerView, stats: Any = None) -> int:
        """Entries each head keeps: the ``budget`` parameter's tokens on this prompt, unless a subclass says else."""
        return self.budget.tokens(view.prompt_length)

    def prefill_scores(self, view: LayerView, stats: Any) -> torch.Tensor:
        """Every cached entry's score after the prompt, [B, H_kv, T] (higher = keep); the decode score by default."""
        return self.decode_scores(view)

    def decode_scores(self, view: LayerView) -> torch.Tensor:
        """Every cached entry's score during decoding, [B, H_kv, T] (or [B, 1, T]: one ranking for every head)."""
        raise NotImplementedError

    def always_kept(self, view: LayerView) -> torch.Tensor | None:
        """Entries kept whatever their score (a bool mask [T]), or None."""
        return None

    def prefill_select(self, view: LayerView, stats: Any) -> torch.Tensor | None:
        return self._top(view, self.keep_count(view, stats), lambda: self.prefill_scores(view, stats))

    def select(self, view: LayerView) -> torch.Tensor | None:
        return self._top(view, self.keep_count(view), lambda: self.decode_scores(view))

    def _top(self, view: LayerView, count: int, scores: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        batch, heads, length = view.positions.shape
        if count >= length:
            return None
        return topk_keep(scores().to(view.positions.device).expand(batch, heads, length), count,
                         self.always_kept(view))


def per_kv_head(per_query_head: torch.Tensor, kv_heads: int, mean: bool = False) -> torch.Tensor:
    """Fold [B, H_q, T] scores over the query heads that share each KV head (GQA): [B, H_kv, T]."""
    batch, q_heads, length = per_query_head.shape
    grouped = per_query_head.reshape(batch, kv_heads, q_heads // kv_heads, length)
    return grouped.mean(2) if mean else grouped.sum(2)


def topk_keep(scores: torch.Tensor, count: int, forced: torch.Tensor | None = None) -> torch.Tensor | None:
    """Keep the ``count`` highest-scoring entries per head (plus ``forced`` ones), returned in ascending order.

    ``scores`` [B, H, T]; ``forced`` a bool mask [T] or [B, H, T] of entries always kept (sinks, recent window).
    """
    length = scores.shape[-1]
    if count >= length:
        return None
    scores = scores.float()
    if forced is not None:
        scores = scores.masked_fill(forced.expand_as(scores), float("inf"))
    if count == length - 1:  # decoding at the budget: one entry in, one out; drop each head's lowest
        kept = torch.arange(length - 1, device=scores.device).expand(*scores.shape[:-1], length - 1)
        return kept + (kept >= scores.argmin(dim=-1, keepdim=True)).long()
    chosen = scores.topk(count, dim=-1).indices
    return chosen.sort(dim=-1).values


class QuantizationMethod(Method):
    """Decides how entries are stored: builds one storage object per layer (see :mod:`kvviz.cache.storage`).

    ``sized_by``: the parameter whose choices set the bits (a sweep tries every choice); None: the bits are fixed.
    """

    kind = "quantization"
    sized_by: ClassVar[str | None] = None

    @classmethod
    def swept_params(cls) -> tuple[str, ...]:
        return (cls.sized_by,) if cls.sized_by else ()

    @classmethod
    def sweep_points(cls, shares: Sequence[float], sizing: Sizing,
                     fixed: dict[str, Any]) -> list[tuple[float, Method]]:
        """Every choice of ``sized_by`` this method accepts, each at the share of full's bits it stores (a
        quantizer's few bit widths are its budgets; ``shares`` do not apply)."""
        param = next((p for p in cls.params if p.name == cls.sized_by), None)
        if param is None or param.choices is None:
            return []
        points = []
        for choice in param.choices:
            try:
                method = cls(**(fixed | {param.name: choice}))
            except SpecError:
                continue  # a choice another parameter rules out (a backend's bit widths)
            points.append((method.bits_per_element(sizing.head_dim) / (8 * sizing.bytes_per_element), method))
        return sorted(points, key=lambda point: point[0])

    def new_storage(self, layer_idx: int):
        raise NotImplementedError

    def bits_per_element(self, head_dim: int, value_dim: int | None = None) -> float:
        """Average stored bits per K/V element including metadata, ignoring any full-precision residual.

        Over one key of ``head_dim`` and one value of ``value_dim`` elements (default ``head_dim``; MLA models cache
        keys wider than values), so ``elements * bits_per_element / 8`` is the quantized cache's size.
        """
        raise NotImplementedError


def per_element(key_bits: float, value_bits: float, head_dim: int, value_dim: int | None) -> float:
    """Bits per element over a key of ``head_dim`` and a value of ``value_dim`` (default ``head_dim``) elements,
    given the bits each of them holds in all (codes and metadata)."""
    return (key_bits + value_bits) / (head_dim + (value_dim or head_dim))


class ArchitectureMethod(Method):
    """Changes what the cache holds per token (fewer KV heads, a low-rank latent) by wrapping the layer's storage.

    The wrapper compresses incoming K/V into the stored form (which the quantizer, if any, stores) and hands
    attention the model's K/V shape back from ``materialize``; that expansion is a simulated kernel and not counted.
    Eviction sees ``cache_heads`` heads: the stored ones.
    """

    kind = "architecture"
    sized_by: ClassVar[str | None] = None  # the parameter :meth:`sweep_points` varies; None: it is not swept

    @classmethod
    def swept_params(cls) -> tuple[str, ...]:
        return (cls.sized_by,) if cls.sized_by else ()

    def check_stack(self, stack: MethodStack) -> None:
        eviction = stack.eviction
        if eviction is not None and not eviction.stacks_with_architecture:
            raise SpecError(f"{eviction.name} does not stack with an architecture method ({self.name}): "
                            f"{eviction.name} {eviction.why_not_with_architecture}")

    def check_model(self, kv_heads: int, head_dim: int) -> None:
        """Raise SpecError when the parameters do not fit a model with this many KV heads of this size."""

    def cache_heads(self, kv_heads: int) -> int:
        """Heads the cache stores per layer (what eviction chooses per head)."""
        return kv_heads

    def cache_fraction(self, kv_heads: int, head_dim: int) -> float:
        """Stored elements per token as a share of the model's ``2 * kv_heads * head_dim``: the formula's factor."""
        return 1.0

    def stored_dim(self, kv_heads: int, head_dim: int) -> int:
        """Length of each stored vector (what a quantizer groups): the head dim, or a latent's rank."""
        return head_dim

    def wrap_storage(self, layer_idx: int, inner: Any, cache: Any) -> Any:
        """The layer's storage: ``inner`` (dense or quantized) holds the stored form; ``cache`` gives positions."""
        raise NotImplementedError
