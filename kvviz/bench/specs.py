"""The SPECs the sections compare: each eviction method at a token budget, and the comparisons built from them."""

from __future__ import annotations

from kvviz.methods import REGISTRY

EVICTIONS = ("window", "streaming_llm", "h2o", "snapkv", "tova", "random", "kvpress")
KIVI = "kivi:bits=2,group=32,residual=128"


def budget_spec(name: str, budget: int, prompt: int) -> str | None:
    """A SPEC for eviction method ``name`` keeping ``budget`` tokens per head, or None when not installed."""
    method = REGISTRY.get(name)
    if method is None:
        return None
    params = {p.name: p for p in method.params}
    if "budget" in params:
        window = params.get("window")
        small = window is not None and window.type is int and window.default >= budget  # SnapKV's vote window
        return f"{name}:budget={budget}" + (f",window={max(1, budget // 2)}" if small else "")
    if name == "streaming_llm":
        return f"streaming_llm:sinks=4,window={budget - 4}"
    if "press" in params:  # a method ranking entries with a kvpress scorer: knorm needs no observation window
        values: dict[str, object] = {"press": "knorm"}
        ratio = f"{max(0.0, 1 - budget / prompt):.4f}"
        values |= {key: ratio for key in ("ratio", "ratios") if key in params}
        if "target" in params:  # decode-time compression: back to the budget every few steps
            values |= {"target": budget, "every": 4}
        if "window" in params and params["window"].default >= budget:
            values["window"] = max(1, budget // 2)
        return f"{name}:" + ",".join(f"{key}={value}" for key, value in values.items())
    if "window" in params:
        return f"{name}:window={budget}"
    if {"heavy", "recent"} <= params.keys():
        return f"{name}:heavy={budget // 2},recent={budget - budget // 2}"
    return name


def eviction_specs(budget: int, prompt: int) -> list[str]:
    return [s for s in (budget_spec(n, budget, prompt) for n in EVICTIONS) if s is not None]


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

