"""Three axes, one budget: spend the same share of the full cache on fewer heads, fewer tokens or fewer bits.

One needle prompt (a pass key hidden in filler, :mod:`kvviz.studies.needle`) replayed under each SPEC: agreement and KL
with full (teacher-forced, :mod:`kvviz.comparison.metrics`), whether the answer holds the key, and the bytes split into
the three factors (:mod:`kvviz.cache.architecture`). ``python -m kvviz axes`` prints it; the Lessons page runs it live.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from kvviz.comparison.session import compare
from kvviz.planning.memory import ModelCard
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.needle import build_needle_prompt


def budget_specs(card: ModelCard, fraction: float) -> dict[str, str]:
    """One SPEC per axis holding about ``fraction`` of the full cache: merged heads, a latent, tokens, bits.

    Heads round to a divisor of the model's KV heads, the rank to an integer, bits to the quantizer's 2/4/8 (KIVI
    with a 32-token residual; on fp32 8 bits plus metadata are about a third, on bf16 about two thirds).
    """
    divisors = [g for g in range(1, card.kv_heads + 1) if card.kv_heads % g == 0]
    heads = min(divisors, key=lambda g: abs(g / card.kv_heads - fraction))
    rank = max(1, round(fraction * card.kv_heads * card.head_dim))
    element_bits = 8 * card.bytes_per_element
    bits = min((2, 4, 8), key=lambda b: abs((b + 1) / element_bits - fraction))
    return {
        "heads": f"merge_heads:kv_heads={heads}",
        "latent": f"lowrank:rank={rank}",
        "tokens": f"snapkv:budget={fraction:g}",
        "bits": f"kivi:bits={bits},residual=32",
    }


def axes_specs(card: ModelCard, budgets: list[float], also: list[str] | None = None) -> list[str]:
    """Every budget's SPECs (each axis alone, latent + tokens, then all three with heads and with the latent), then
    ``also``; each SPEC once, in that order, so one command gives one table."""
    specs: list[str] = []
    for fraction in budgets:
        axis = budget_specs(card, fraction)
        heads, latent, tokens, bits = axis["heads"], axis["latent"], axis["tokens"], axis["bits"]
        specs += [*axis.values(), f"{latent}+{tokens}", f"{heads}+{tokens}+{bits}", f"{latent}+{tokens}+{bits}"]
    return list(dict.fromkeys([*specs, *(also or [])]))


@dataclass
class AxisRow:
    """One SPEC on the needle prompt."""

    method: str
    kv_bytes: int
    share_of_full: float
    agreement: float | None
    mean_kl: float | None
    needle_found: bool
    architecture: float
    eviction: float
    quantization: float
    text: str
    error: str | None = None

    MARKDOWN_HEADER: ClassVar[tuple[str, str]] = (
        "| SPEC | KV bytes | share of full | heads × tokens × bits | agreement | mean KL | needle |",
        "|---|---|---|---|---|---|---|")

    def to_json(self) -> dict:
        return asdict(self)

    def markdown_row(self) -> str:
        """This row under :attr:`MARKDOWN_HEADER`: bytes, share of full, the three factors, quality, the needle."""
        if self.error:
            return f"| `{self.method}` | failed: {self.error} | | | | | |"
        quality = "" if self.agreement is None else f"{self.agreement:.0%} | {self.mean_kl:.3f}"
        return (f"| `{self.method}` | {self.kv_bytes:,} | {self.share_of_full:.3f} | {self.architecture:.3f} × "
                f"{self.eviction:.3f} × {self.quantization:.3f} | {quality} | "
                f"{'found' if self.needle_found else 'missed'} |")


def run_axes(loaded: LoadedModel, specs: list[str], length: int = 512, depth: float = 0.5,
             max_new_tokens: int = 12, progress: Progress | None = None) -> tuple[list[AxisRow], str]:
    """Replay ``specs`` (full added first) on one chat needle prompt; returns the rows and the key."""
    prompt = build_needle_prompt(loaded.tokenizer, length, depth, chat=True)
    comparison = compare(loaded, prompt.ids, specs, max_new_tokens, progress=progress)
    rows = []
    for result in comparison.results:
        factors = result.axis_factors
        rows.append(AxisRow(
            method=result.method, kv_bytes=result.kv_bytes,
            share_of_full=result.kv_bytes / result.kv_bytes_full if result.kv_bytes_full else 0.0,
            agreement=result.agreement_with_full, mean_kl=result.mean_kl, needle_found=prompt.key in result.text,
            architecture=factors.architecture if factors else 1.0, eviction=factors.eviction if factors else 1.0,
            quantization=factors.quantization if factors else 1.0, text=result.text, error=result.error))
    return rows, prompt.key
