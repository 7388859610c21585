"""The SPECs the sections compare: each eviction method at a token budget, and the comparisons built from them."""

from __future__ import annotations

from kvviz.methods import REGISTRY, budget_spec

KIVI = "kivi:bits=2,group=32,residual=128"
# issue 13's comparison, as a student runs it on Compare: six configurations (on a 2K-token upload)
APP_SPECS = ("full", "streaming_llm:sinks=4,window=252", "snapkv:budget=256", "h2o:heavy=128,recent=128",
             "kivi:bits=2", "snapkv:budget=256+kivi:bits=2")


def app_specs(prompt: int) -> tuple[str, ...]:
    """The issue's six configurations for a prompt of 1K tokens or more; three small ones for quick runs."""
    return APP_SPECS if prompt >= 1024 else ("full", "window:window=16", "kivi:bits=2")


def evictions() -> list[str]:
    """Every registered eviction method but ``full``, by name: a new method is benchmarked without touching this."""
    return sorted(name for name, method in REGISTRY.items() if method.kind == "eviction" and name != "full")


def eviction_specs(budget: int, prompt: int) -> list[str]:
    """Each eviction method that can be sized for ``budget`` tokens of a ``prompt``-token prompt."""
    return [s for s in (budget_spec(n, budget, prompt) for n in evictions()) if s is not None]


def comparison_specs(budget: int, prompt: int, count: int = 5) -> list[str]:
    """``count`` SPECs for the shared-prefill comparison: full plus the installed evictions (kivi if short)."""
    specs = ["full", *eviction_specs(budget, prompt)][:count]
    if len(specs) < count and "kivi" in REGISTRY:
        specs.append(KIVI)
    return specs


def batched_specs(budget: int, prompt: int) -> list[str]:
    """The comparison of issue 13 at ``budget`` tokens (256 at a 2K prompt): full, StreamingLLM, SnapKV, H2O, KIVI
    2-bit and SnapKV+KIVI, those installed."""
    snapkv = budget_spec("snapkv", budget, prompt)
    specs = ["full", budget_spec("streaming_llm", budget, prompt), snapkv, budget_spec("h2o", budget, prompt)]
    if "kivi" in REGISTRY:
        specs += ["kivi:bits=2", snapkv and f"{snapkv}+kivi:bits=2"]
    return [spec for spec in specs if spec]

