"""The frontier of a sweep: the configurations nothing beats on both memory and quality, and what they recommend.

A point is dominated when another point holds no more bytes and has no worse quality, and is strictly better on
one of the two; the frontier is every point that is not. Two points with the same bytes and the same quality are
both on it (neither beats the other). A point without a measured quality (a failed run, a measure that does not
apply) is never on it and never beats anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    """One quality measure of a sweep: its name in the points, how it reads, and which way is better."""

    key: str
    label: str
    higher_is_better: bool
    percent: bool = False

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def text(self, value: float) -> str:
        return f"{value:.0%}" if self.percent else f"{value:.3g}"


AGREEMENT = Measure("agreement_with_full", "agreement with full", True, percent=True)
MEAN_KL = Measure("mean_kl", "mean KL", False)
ACCURACY = Measure("accuracy", "accuracy", True, percent=True)
PERPLEXITY = Measure("perplexity", "perplexity", False)
MEASURES = {m.key: m for m in (AGREEMENT, MEAN_KL, ACCURACY, PERPLEXITY)}


def on_frontier(points: Sequence[tuple[float | None, float | None]], measure: Measure) -> list[bool]:
    """For each (bytes, quality) pair, whether no other pair beats it (see the module's docstring)."""
    measured = [(i, b, q) for i, (b, q) in enumerate(points) if b is not None and q is not None]
    flags = [False] * len(points)
    for index, size, quality in measured:
        flags[index] = not any(
            other_size <= size and not measure.better(quality, other_quality)
            and (other_size < size or measure.better(other_quality, quality))
            for other, other_size, other_quality in measured if other != index)
    return flags


@dataclass(frozen=True)
class Candidate:
    """What the recommendation reads of one point: its SPEC, the axis its family varies, compression, quality."""

    spec: str
    kind: str  # "eviction", "quantization", "architecture", "stack" or "fixed"
    compression: float | None
    quality: float | None


KIND_WORDS = {"eviction": "eviction", "quantization": "quantizer", "architecture": "head or latent reduction",
              "stack": "stack", "fixed": "fixed configuration"}
TARGETS = (2.0, 4.0, 8.0, 16.0)  # compressions the summary speaks about, where some point reaches them


def recommendation(candidates: Sequence[Candidate], measure: Measure, scope: str) -> list[str]:
    """Sentences a reader can act on: at each compression some point reaches, the best point there and the best of
    every other kind of method, then the scope (what one run can and cannot tell)."""
    lines = []
    usable = [c for c in candidates if c.compression is not None and c.quality is not None and c.spec != "full"]
    for target in TARGETS:
        reaching = [c for c in usable if c.compression >= target * 0.95]  # a budget's rounding stays in the band
        if not reaching:
            break
        best = _best(reaching, measure)
        sentence = (f"{scope}, at {target:g}x smaller than full or more, {best.spec} keeps "
                    f"{measure.text(best.quality)} {measure.label}")
        others = []
        for kind in KIND_WORDS:
            of_kind = [c for c in reaching if c.kind == kind and c.kind != best.kind]
            if of_kind:
                runner = _best(of_kind, measure)
                others.append(f"the best {KIND_WORDS[kind]} ({runner.spec}) keeps {measure.text(runner.quality)}")
        lines.append(sentence + ("; " + "; ".join(others) if others else "") + ".")
    if not lines:
        lines.append(f"{scope}, no configuration was measured below full's size.")
    return lines


def _best(candidates: Sequence[Candidate], measure: Measure) -> Candidate:
    """The best quality, the smaller cache on a tie."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if measure.better(candidate.quality, best.quality) or (
                candidate.quality == best.quality and candidate.compression > best.compression):
            best = candidate
    return best
