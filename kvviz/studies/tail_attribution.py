"""Attribution for the tail tasks: what a method's eviction ledger did to each planted span, and why a failed
answer failed (a span it needed was evicted, or nothing planted was and the stack quantizes)."""

from __future__ import annotations

from dataclasses import dataclass

from kvviz.cache.ledger import KEPT
from kvviz.studies.needle import needle_eviction
from kvviz.studies.tail_items import PlantedSpan, TailItem


@dataclass
class SpanFate:
    """What a method's cache did to one planted span: evicted from some layer and head or not, when, where."""

    label: str
    role: str
    evicted: bool
    evicted_step: int | None  # earliest eviction of any of its tokens (0 = prefill compression)
    evicted_layers: list[int]


def span_fates(ledger, spans: list[PlantedSpan]) -> list[SpanFate]:
    """Each planted span's fate from a method's eviction ledger (None: nothing was ever evicted)."""
    fates = []
    for span in spans:
        survived, step, layers = needle_eviction(ledger, span.positions)
        fates.append(SpanFate(span.label, span.role, not survived, step, layers))
    return fates


def failure_cause(item: TailItem, checks: dict[str, bool], fates: list[SpanFate], quantized: bool) -> str:
    """Why a failed cell failed, from the spans its failed checks needed (see :class:`TailCell`)."""
    needed = {f.label for f in fates if f.role in ("target", "value", "hop", "pass key")}
    if item.instructions:
        failed = {int(key.split(":")[0]) for key, ok in checks.items() if not ok}
        needed = {f.label for f in fates if f.role == "instruction" and int(f.label.split()[1].rstrip(":")) in failed}
    if any(f.evicted for f in fates if f.label in needed):
        return "evicted"
    return "quantization" if quantized else "not evicted"


def evicted_share(ledger, length: int) -> list[float]:
    """Per prompt token, the share of its (layer, KV head) entries evicted by the end."""
    table = ledger.evicted_at[..., :length]
    return [round(v, 3) for v in (table != KEPT).float().mean(dim=(0, 1)).tolist()]
