"""The method protocol, the registry and the SPEC grammar.

Every architecture, eviction or quantization method is one class in one file of this package. It declares its
parameters once (:class:`Param`); the CLI parser, the app's widgets and the docs all read that declaration. A SPEC names
one method or a stack of them, at most one per axis: ``name[:key=value,key=value][+name[:key=value,...]]``, e.g.
``snapkv:budget=256+kivi:bits=2`` or ``lowrank:rank=96+snapkv:budget=256+kivi:bits=4``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvviz.core.capture import CaptureConfig
from kvviz.core.storage import KeptRanges


class SpecError(ValueError):
    """A SPEC that cannot be used; the message is one line naming the valid choices."""


@dataclass(frozen=True)
class Budget:
    """A token budget: a count (``256``, written without a decimal point) or a ratio of a reference length (``0.25``,
    ``1.0`` = all of it, written with one). :meth:`read` applies that rule to what users type."""

    value: float
    ratio: bool | None = None  # None: decided by the value (below 1 is a ratio), for budgets built in code

    RULE: ClassVar[str] = "a token count without a decimal point (256) or a ratio of the prompt with one (0.25, 1.0)"

    def __post_init__(self) -> None:
        if self.ratio is None:
            object.__setattr__(self, "ratio", self.value < 1)

    @classmethod
    def read(cls, raw: Any) -> Budget:
        """A budget from a SPEC value or a Python number: a decimal point (or a float) makes it a ratio."""
        if isinstance(raw, Budget):
            return raw
        if isinstance(raw, bool):
            raise ValueError("a budget is a number")
        text = str(raw).strip()
        is_ratio = isinstance(raw, float) or any(mark in text for mark in ".eE")
        value = float(text)
        if not math.isfinite(value) or value <= 0 or (is_ratio and value > 1) or (not is_ratio and value % 1):
            raise ValueError(f"budget {text}: expected {cls.RULE}")
        return cls(value, is_ratio)

    @property
    def is_ratio(self) -> bool:
        return bool(self.ratio)

    def tokens(self, length: int) -> int:
        """Tokens this budget allows for a sequence of ``length`` tokens (at least one)."""
        if self.is_ratio:
            return max(1, math.ceil(self.value * length))
        return int(self.value)

    def __str__(self) -> str:
        if not self.is_ratio:
            return str(int(self.value))
        text = f"{self.value:g}"
        return text if any(mark in text for mark in ".e") else f"{text}.0"


@dataclass(frozen=True)
class Param:
    """One parameter of a method: its name, type, default, allowed range or choices, and help text."""

    name: str
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None

    def describe_range(self) -> str:
        if self.choices is not None:
            return "|".join(str(c) for c in self.choices)
        if self.type is bool:
            return "0|1"
        if self.type is Budget:
            return f"{Budget.RULE}; a ratio lies in (0, 1]"
        low = "-inf" if self.min is None else f"{self.min:g}"
        high = "inf" if self.max is None else f"{self.max:g}"
        return f"{self.type.__name__} in [{low}, {high}]"

    def parse(self, method: str, raw: Any) -> Any:
        """Convert and check one value; raise SpecError with the valid range on failure."""
        where = f"{method}:{self.name}={raw}"
        try:
            if self.type is bool:
                if isinstance(raw, bool):
                    value = raw
                elif str(raw).lower() in ("1", "true", "yes", "on"):
                    value = True
                elif str(raw).lower() in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError
            elif self.type is Budget:
                value = Budget.read(raw)
            elif self.type is int:
                as_float = float(raw)
                if not as_float.is_integer():
                    raise ValueError
                value = int(as_float)
            else:
                value = self.type(raw)
                if self.type is float and not math.isfinite(value):
                    raise ValueError
        except (TypeError, ValueError):
            raise SpecError(f"bad value in '{where}': expected {self.describe_range()}") from None
        if self.choices is not None and value not in self.choices:
            raise SpecError(f"bad value in '{where}': choose {self.describe_range()}")
        number = value.value if isinstance(value, Budget) else value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if (self.min is not None and number < self.min) or (self.max is not None and number > self.max):
                raise SpecError(f"bad value in '{where}': expected {self.describe_range()}")
        return value


class Method:
    """Base of every method: a name, a kind, declared parameters, and validated values as attributes."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # one of KINDS
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()

    def __init__(self, **values: Any):
        known = {p.name: p for p in self.params}
        for key in values:
            if key not in known:
                valid = ", ".join(known) or "none"
                raise SpecError(f"unknown parameter '{key}' for {self.name}; valid: {valid}")
        for param in self.params:
            raw = values.get(param.name, param.default)
            setattr(self, param.name, param.parse(self.name, raw))
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise SpecError with a one-line message."""

    def check_stack(self, stack: MethodStack) -> None:
        """Checks against the other member of a stack (e.g. re-rotation cannot touch quantized keys)."""

    def values(self) -> dict[str, Any]:
        return {p.name: getattr(self, p.name) for p in self.params}

    def spec(self) -> str:
        """The canonical SPEC text: only parameters that differ from their defaults."""
        changed = [
            f"{p.name}={_format_value(getattr(self, p.name))}"
            for p in self.params
            if getattr(self, p.name) != p.parse(self.name, p.default)
        ]
        return self.name + (":" + ",".join(changed) if changed else "")

    def __repr__(self) -> str:
        return f"<{self.spec()}>"


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


REGISTRY: dict[str, type[Method]] = {}
KINDS = ("architecture", "eviction", "quantization")  # the three axes, in SPEC order: fewer heads, tokens, bits


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available to SPECs, the CLI, the app and the docs."""
    if not cls.name or cls.kind not in KINDS:
        raise TypeError(f"{cls.__name__} needs a name and a kind of {', '.join(map(repr, KINDS))}")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class MethodStack:
    """What one SPEC describes: at most one method per axis (architecture, eviction, quantization)."""

    eviction: Method | None = None
    quantization: Method | None = None
    architecture: Method | None = None

    @property
    def label(self) -> str:
        parts = [m.spec() for m in self.members()]
        return "+".join(parts) if parts else "full"

    def members(self) -> list[Method]:
        return [m for m in (self.architecture, self.eviction, self.quantization) if m is not None]


def parse_spec(spec: str) -> MethodStack:
    """Parse ``name[:k=v,...][+name[:k=v,...]...]`` into a :class:`MethodStack`; SpecError on any mistake."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty method SPEC; valid methods: {', '.join(sorted(REGISTRY))}")
    stack = MethodStack()
    for part in spec.strip().split("+"):
        name, _, arguments = part.strip().partition(":")
        name = name.strip()
        if name not in REGISTRY:
            raise SpecError(f"unknown method '{name}'; valid: {', '.join(sorted(REGISTRY))}")
        values: dict[str, str] = {}
        for item in filter(None, (a.strip() for a in arguments.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise SpecError(f"bad argument '{item}' in '{part}': write key=value")
            if key.strip() in values:
                raise SpecError(f"parameter '{key.strip()}' given twice in '{part}'")
            values[key.strip()] = value.strip()
        method = REGISTRY[name](**values)
        slot = method.kind
        if getattr(stack, slot) is not None:
            existing = getattr(stack, slot).name
            raise SpecError(f"'{spec}' stacks two {slot} methods ({existing}, {name}); use at most one per axis "
                            "(architecture+eviction+quantization)")
        setattr(stack, slot, method)
    for method in stack.members():
        method.check_stack(stack)
    return stack


# ----------------------------------------------------------------------------------------------------------------
# Protocols the cache calls. Eviction methods choose which entries stay; quantization methods decide how they are
# stored. Both see tensors only.


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


class EvictionMethod(Method):
    """Decides which cached entries each layer keeps.

    ``scores_attention``: the method needs the current queries' attention at every decode step (H2O, TOVA); it is
    then called after attention, and the cache may hold one token over budget while attending. Otherwise it is called
    right after new entries are appended, before attention, so attention never sees more than the budget.
    ``rerotate``: cached keys take their positions inside the cache (StreamingLLM's position shift); such a method
    keeps the same entries in every head, so one set of rotary positions serves them all.
    ``uses_prefill_attention``: the method reads the prefill's accumulated attention per key (H2O's initial scores).
    ``prefill_windows``: observation windows whose attention sums the method reads at prefill (SnapKV).
    ``prefill_layer_inputs``: the method reads each attention module's prefill input (hidden states and rotary
    embeddings, in ``AttentionStats.layer_inputs``), as kvpress scorers do.
    """

    kind = "eviction"
    scores_attention: ClassVar[bool] = False
    uses_prefill_attention: ClassVar[bool] = False
    prefill_windows: ClassVar[tuple[int, ...]] = ()
    stacks_with_architecture: ClassVar[bool] = True  # False: refused next to merge_heads / lowrank, with the reason
    why_not_with_architecture: ClassVar[str] = ""
    prefill_layer_inputs: ClassVar[bool] = False  # the method reads each attention layer's prefill input (kvpress)
    own_prefill: ClassVar[bool] = False  # the method runs the prompt itself (``run_prefill(session)``: kvpress native)
    # and leaves what it found in ``report`` (carried into MethodResult.native_report)
    compresses_prompt_only: ClassVar[bool] = False  # True: the prompt is compressed once and nothing is evicted as
    # tokens arrive (SnapKV, kvpress presses), so a token-by-token stream (streaming perplexity) never compresses

    @property
    def rerotate(self) -> bool:
        return False

    def capture_needs(self) -> CaptureConfig | None:
        """What this method reads from the prefill, from its declarations above (None: nothing). A comparison's
        needs are united (:meth:`CaptureConfig.merged`) so that one prefill serves every method."""
        if not (self.prefill_windows or self.uses_prefill_attention or self.prefill_layer_inputs):
            return None
        return CaptureConfig(windows=tuple(self.prefill_windows), layer_inputs=self.prefill_layer_inputs,
                             all_queries=self.uses_prefill_attention)

    def new_state(self, layer_idx: int) -> Any:
        return None

    def prefill_select(self, view: LayerView, stats: Any) -> torch.Tensor | KeptRanges | None:
        """After the prompt's forward: entries to keep as :meth:`select` returns them, or None to keep all.

        ``stats`` is the prefill's :class:`kvviz.core.capture.AttentionStats` (when the method asked for capture).
        """
        return self.select(view)

    def prefill_blocked(self, layer_idx: int) -> torch.Tensor | None:
        """After :meth:`prefill_select`: entries [B, H_kv, T] (True) the layer holds but never attends, so heads that
        keep different counts share one length (kvpress's head-wise presses); None for none."""
        return None

    def select(self, view: LayerView) -> torch.Tensor | KeptRanges | None:
        """During decoding: indices [B, H_kv, n] (ascending) of entries to keep, or :class:`KeptRanges` when every
        head keeps the same ranges (cheaper to apply), or None to keep all."""
        return None

    def budget_for(self, prompt_length: int) -> int | None:
        """Tokens kept per head at steady state, for the memory formula; None when unbounded."""
        return None

    def layer_budget_for(self, prompt_length: int, layer_idx: int, layers: int) -> int | None:
        """Tokens kept per head in layer ``layer_idx`` of ``layers`` at steady state: :meth:`budget_for` unless
        the method spreads its budget over layers (pyramidkv, per_layer)."""
        return self.budget_for(prompt_length)

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

    def check_context(self, prompt_length: int) -> None:
        """Raise SpecError when the parameters cannot work on a prompt of this length."""



class ScoringEviction(EvictionMethod):
    """An eviction method that is its score: the base applies the budget and keeps the top entries per head.

    A subclass gives :meth:`prefill_scores` (and :meth:`decode_scores` unless it compresses the prompt only); when
    the budget covers every entry nothing is scored, as kvpress's ``ScorerPress`` does.
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
        if self.compresses_prompt_only:
            return None  # tokens generated after the prompt are all kept
        return self._top(view, self.keep_count(view), lambda: self.decode_scores(view))

    def _top(self, view: LayerView, count: int, scores: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        batch, heads, length = view.positions.shape
        if count >= length:
            return None
        return topk_keep(scores().to(view.positions.device).expand(batch, heads, length), count,
                         self.always_kept(view))


def budget_spec(name: str, tokens: int, prompt_length: int | None = None, **overrides: Any) -> str | None:
    """The SPEC of eviction method ``name`` keeping about ``tokens`` entries per head (its ``at_budget``), with
    ``overrides`` applied; None when the method is not registered, cannot be sized so, or rejects the values."""
    method = REGISTRY.get(name)
    if method is None or method.kind != "eviction":
        return None
    try:
        sized = method.at_budget(tokens, prompt_length)
        if sized is None:
            return None
        return (type(sized)(**({p.name: getattr(sized, p.name) for p in sized.params} | overrides)).spec()
                if overrides else sized.spec())
    except SpecError:
        return None

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
    chosen = scores.topk(count, dim=-1).indices
    return chosen.sort(dim=-1).values


class QuantizationMethod(Method):
    """Decides how entries are stored: builds one storage object per layer (see :mod:`kvviz.core.storage`)."""

    kind = "quantization"

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
