"""Capacity planning for well-known models: KV gigabytes for a context and batch, and how many sequences fit.

The model shapes and GPU sizes ship as data in ``assets/model_configs.json``. A plan composes the three families:
the architecture (MHA, GQA, MQA or MLA, and which layers slide over a window: fixed by the model), eviction (a token
budget per sequence, on global layers) and quantization (stored bits per element plus per-group metadata, with an
optional full-precision residual).
Sizes are in GB = 10^9 bytes, like the GPU sizes they are compared with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvviz.cache.quant import bits_with_metadata
from kvviz.planning.memory import ModelCard, card_from_config

CATALOG_PATH = Path(__file__).resolve().parents[2] / "assets" / "model_configs.json"
GB = 1e9


@dataclass(frozen=True)
class Catalog:
    """Known model configurations (config.json fields plus ``parameters``) and GPU memory sizes in GB."""

    models: dict[str, dict]
    gpus: dict[str, float]

    def card(self, name: str, dtype: str = "bfloat16") -> ModelCard:
        """The model card of a catalog entry, with 16-bit weights."""
        config = self.models[name]
        return card_from_config(name, config, dtype, weight_bytes=int(config["parameters"] * 2))


    def context(self, name: str) -> int:
        """The context length the model's card publishes (``context``), else its config's position count."""
        config = self.models[name]
        return int(config.get("context") or config.get("max_position_embeddings") or 0)

    def contexts(self, name: str, shortest: int = 512) -> list[int]:
        """Context lengths a slider offers for this model: doublings from ``shortest`` up to its published context."""
        limit = max(self.context(name), shortest)
        lengths = [shortest << k for k in range(limit.bit_length()) if shortest << k <= limit]
        return lengths if lengths[-1] == limit else [*lengths, limit]


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    data = json.loads(Path(path).read_text())
    return Catalog(models=data["models"], gpus={k: float(v) for k, v in data["gpus"].items()})


@dataclass(frozen=True)
class Plan:
    """One serving scenario.

    ``budget``: eviction budget per sequence, a token count (>= 1) or a ratio of the context (< 1); None keeps all.
    ``kv_bits``: stored bits per K/V element (16 = bf16/fp16); ``group_size``: elements sharing one scale and zero
    point (0: no metadata); ``residual_tokens``: most recent tokens kept at 16 bits (KIVI's residual).
    """

    context: int
    batch: int = 1
    budget: float | None = None
    kv_bits: float = 16
    group_size: int = 0
    residual_tokens: int = 0
    weight_bits: float = 16
    gpu_gb: float = 80
    utilization: float = 0.9  # share of GPU memory available to weights + KV (the rest: activations, runtime)


@dataclass(frozen=True)
class PlanResult:
    tokens_cached: int
    kv_bytes_per_sequence: int
    kv_bytes_full_per_sequence: int
    kv_bytes_total: int
    weight_bytes: int
    usable_bytes: int
    max_sequences: int

    @property
    def fits(self) -> bool:
        return self.weight_bytes + self.kv_bytes_total <= self.usable_bytes

    @property
    def compression(self) -> float:
        return self.kv_bytes_full_per_sequence / max(1, self.kv_bytes_per_sequence)


def cached_tokens(context: int, budget: float | None) -> int:
    """Tokens an eviction budget keeps out of ``context``."""
    if budget is None:
        return context
    if budget < 1:
        return min(context, max(1, math.ceil(budget * context)))
    return min(context, int(budget))


def effective_bits(kv_bits: float, group_size: int) -> float:
    """Bits per element including each group's scale and zero point."""
    if kv_bits >= 16 or group_size <= 0:
        return float(kv_bits)
    return bits_with_metadata(kv_bits, group_size)


def kv_bytes_per_sequence(card: ModelCard, plan: Plan) -> int:
    """KV bytes one sequence holds under the plan's eviction and quantization, layer by layer: a global layer holds
    the budget's tokens, a local (sliding-window) layer its window whatever the budget (eviction runs on global
    layers only, as kvviz's methods do)."""
    bits = 0.0
    for window in card.layer_types.windows:
        tokens = cached_tokens(plan.context, plan.budget) if window is None else min(plan.context, window - 1)
        residual = min(tokens, plan.residual_tokens) if plan.kv_bits < 16 else 0
        bits += (tokens - residual) * effective_bits(plan.kv_bits, plan.group_size) + residual * 16
    return int(card.kv_elements_per_token // card.layers * bits / 8)


def make_plan(card: ModelCard, parameters: float, plan: Plan) -> PlanResult:
    """Compose the plan for one model; ``parameters`` is its total parameter count."""
    per_sequence = kv_bytes_per_sequence(card, plan)
    weights = int(parameters * plan.weight_bits / 8)
    usable = int(plan.gpu_gb * GB * plan.utilization)
    room = usable - weights
    return PlanResult(
        tokens_cached=cached_tokens(plan.context, plan.budget),
        kv_bytes_per_sequence=per_sequence,
        kv_bytes_full_per_sequence=card.kv_bytes(plan.context, bytes_per_element=2),
        kv_bytes_total=per_sequence * plan.batch,
        weight_bytes=weights,
        usable_bytes=usable,
        max_sequences=max(0, room // per_sequence) if per_sequence else 0,
    )


def attention_variants(card: ModelCard) -> dict[str, int]:
    """16-bit KV bytes per token if this model's layers used MHA, its own GQA, MQA, or (when it has one) MLA; with
    local layers, what each token past their window costs (its global layers only) as well."""
    per_layer_head = 2 * card.head_dim * 2
    variants = {"MHA": card.layers * card.q_heads * per_layer_head}
    if card.attention == "GQA":
        variants[f"GQA ({card.kv_heads} KV heads)"] = card.layers * card.kv_heads * per_layer_head
    variants["MQA"] = card.layers * per_layer_head
    if card.attention == "MLA":
        variants[f"MLA (latent {card.mla_latent_dim})"] = card.layers * card.mla_latent_dim * 2
    types = card.layer_types
    if types.has_local:
        variants[f"past the {types.window}-token window ({types.global_layers} global layers)"] = (
            types.global_layers * card.kv_heads * per_layer_head)
    return variants


def method_bits(spec: str, head_dim: int) -> float:
    """Average stored bits per element of a registered quantization method SPEC (metadata included)."""
    from kvviz.methods import SpecError, parse_spec

    stack = parse_spec(spec)
    if stack.quantization is None:
        raise SpecError(f"'{spec}' has no quantization method")
    return float(stack.quantization.bits_per_element(head_dim))


@dataclass(frozen=True)
class LayoutProjection:
    """One serving layout of a configuration measured on another model, projected onto this model's shape: the
    share of the full cache it holds there, the bytes per sequence that gives here, and the sequences that fit."""

    layout: str
    share_of_full: float
    kv_bytes_per_sequence: int
    max_sequences: int


def project_layouts(card: ModelCard, parameters: float, plan: Plan, held: dict[str, int],
                    full_bytes: int) -> list[LayoutProjection]:
    """Each layout's bytes ``held`` by a configuration measured on a (usually smaller) model whose full cache held
    ``full_bytes``, as a share of that full cache applied to ``card``'s 16-bit full cache at the plan's context; the
    plan's GPU, weights and utilization say how many such sequences fit. A projection, not a measurement: the
    larger model's heads would choose their own tokens."""
    base = make_plan(card, parameters, Plan(**{**plan.__dict__, "budget": None, "kv_bits": 16, "group_size": 0,
                                               "residual_tokens": 0}))
    room = base.usable_bytes - base.weight_bytes
    projections = []
    for layout, held_bytes in held.items():
        share = held_bytes / full_bytes
        per_sequence = max(1, math.ceil(share * base.kv_bytes_full_per_sequence))
        projections.append(LayoutProjection(layout, share, per_sequence, max(0, room // per_sequence)))
    return projections
