"""The frontier of a sweep: the configurations nothing beats on both memory and quality, and what they recommend.

A point is dominated when another point holds no more bytes and has no worse quality, and is strictly better on
one of the two; the frontier is every point that is not. Two points with the same bytes and the same quality are
both on it (neither beats the other). A point without a measured quality (a failed run, a measure that does not
apply) is never on it and never beats anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvviz.studies.intervals import overlap


@dataclass(frozen=True)
class Measure:
    """One quality measure of a sweep: its name in the points, how it reads, which way is better, and where its
    95% interval is kept (None: a measure without one)."""

    key: str
    label: str
    higher_is_better: bool
    percent: bool = False
    interval: str | None = None

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def text(self, value: float) -> str:
        return f"{value:.0%}" if self.percent else f"{value:.3g}"


    def with_interval(self, value: float, interval: tuple[float, float] | None) -> str:
        if interval is None:
            return self.text(value)
        low, high = (f"{v * 100:.0f}" if self.percent else f"{v:.3g}" for v in interval)
        return f"{self.text(value)} [{low}, {high}]"


AGREEMENT = Measure("agreement_with_full", "agreement with full", True, percent=True, interval="agreement_ci")
MEAN_KL = Measure("mean_kl", "mean KL", False)
KL_P95 = Measure("kl_p95", "95th-percentile per-token KL", False)
WORST_PROMPT = Measure("worst_prompt_agreement", "worst prompt's agreement", True, percent=True)
ACCURACY = Measure("accuracy", "accuracy", True, percent=True, interval="accuracy_ci")
PERPLEXITY = Measure("perplexity", "perplexity", False)
MEASURES = {m.key: m for m in (AGREEMENT, MEAN_KL, KL_P95, WORST_PROMPT, ACCURACY, PERPLEXITY)}


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
    """What the recommendation reads of one point: its SPEC, the axis its family varies, compression, quality, the
    quality's 95% interval and whether that interval overlaps full's (None: no interval to tell)."""

    spec: str
    kind: str  # "eviction", "quantization", "architecture", "stack" or "fixed"
    compression: float | None
    quality: float | None
    interval: tuple[float, float] | None = None
    like_full: bool | None = None


KIND_WORDS = {"eviction": "eviction", "quantization": "quantizer", "architecture": "head or latent reduction",
              "stack": "stack", "fixed": "fixed configuration"}
TARGETS = (2.0, 4.0, 8.0, 16.0)  # compressions the summary speaks about, where some point reaches them
LIKE_FULL = "indistinguishable from full at this sample size"


def recommendation(candidates: Sequence[Candidate], measure: Measure, scope: str) -> list[str]:
    """Sentences a reader can act on, at each compression some point reaches. With intervals: the configurations
    indistinguishable from full there, else the best measured and every one that cannot be told apart from it;
    configurations whose intervals overlap are never ranked. Without: the best point and the best of every other
    kind of method."""
    lines = []
    usable = [c for c in candidates if c.compression is not None and c.quality is not None and c.spec != "full"]
    for target in TARGETS:
        reaching = [c for c in usable if c.compression >= target * 0.95]  # a budget's rounding stays in the band
        if not reaching:
            break
        lead = f"{scope}, at {target:g}x smaller than full or more"
        if all(c.interval is not None for c in reaching):
            lines.append(f"{lead}, {_with_intervals(reaching, measure)}.")
            continue
        best = _best(reaching, measure)
        sentence = f"{lead}, {best.spec} keeps {measure.text(best.quality)} {measure.label}"
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


def _with_intervals(reaching: list[Candidate], measure: Measure) -> str:
    """Which of ``reaching`` are indistinguishable from full, or else which cannot be told from the best."""
    def named(group: list[Candidate]) -> str:
        ordered = sorted(group, key=lambda c: -c.compression)  # most compressed first: an order that ranks nothing
        return ", ".join(f"{c.spec} ({measure.with_interval(c.quality, c.interval)})" for c in ordered)

    like_full = [c for c in reaching if c.like_full]
    if like_full:
        return f"{LIKE_FULL}: {named(like_full)}"
    best = _best(reaching, measure)
    if measure.higher_is_better and best.quality == 0:
        return f"nothing is {LIKE_FULL}; every configuration there scores {measure.text(0.0)}"
    tied = [c for c in reaching if c is not best and overlap(c.interval, best.interval)]
    below = [c for c in reaching if c is not best and c not in tied]
    text = f"nothing is {LIKE_FULL}; the best measured is {named([best])}"
    if tied:
        text += f", and cannot be told apart from {named(tied)}"
    if below:
        text += f"; {len(below)} {'others fall' if len(below) > 1 else 'other falls'} below its interval"
    return text


@dataclass(frozen=True)
class Cliff:
    """Where a family falls off: ``spec`` is its most compressed point still indistinguishable from full, walking
    up from its least compressed (None: not even that one); ``past`` the first point beyond, which is not (None:
    it held at every budget measured)."""

    family: str
    spec: str | None
    compression: float | None
    past: str | None = None
    past_compression: float | None = None

    def sentence(self) -> str:
        if self.spec is None:
            return (f"{self.family} is distinguishable from full already at its least compressed point, "
                    f"{self.past_compression:.1f}x ({self.past}).")
        if self.past is None:
            return (f"{self.family} stays {LIKE_FULL} at every budget measured, up to {self.compression:.1f}x "
                    f"({self.spec}).")
        return (f"{self.family}'s cliff: {LIKE_FULL} up to {self.compression:.1f}x ({self.spec}); at "
                f"{self.past_compression:.1f}x ({self.past}) it is not.")


def find_cliff(family: str, points: Sequence[tuple[str, float, bool | None]]) -> Cliff | None:
    """The cliff of a family from its points (SPEC, compression, indistinguishable from full), None when some point
    has no interval to tell. A point more compressed than the first distinguishable one does not move the cliff
    back: the family has already fallen off once."""
    if not points or any(like is None for _, _, like in points):
        return None
    held: tuple[str, float] | None = None
    for spec, compression, like_full in sorted(points, key=lambda p: p[1]):
        if not like_full:
            return Cliff(family, *(held or (None, None)), spec, compression)
        held = (spec, compression)
    return Cliff(family, *held)


def _best(candidates: Sequence[Candidate], measure: Measure) -> Candidate:
    """The best quality, the smaller cache on a tie."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if measure.better(candidate.quality, best.quality) or (
                candidate.quality == best.quality and candidate.compression > best.compression):
            best = candidate
    return best
