"""Every eviction method sizes itself for a token budget (``at_budget``), so sweeps, the bench and page defaults
need no per-method knowledge: the cache it leaves holds about that many entries per head."""

from __future__ import annotations

import pytest

from kvviz.comparison.session import PromptSession
from kvviz.methods import REGISTRY, Budget, budget_spec

PROMPT, BUDGET, STEPS = 64, 24, 6  # decoding compresses on the step after its 4th
EVICTIONS = sorted(n for n, m in REGISTRY.items() if m.kind == "eviction" and n != "full")


@pytest.mark.parametrize("name", EVICTIONS)
def test_a_method_sized_for_a_budget_keeps_about_that_many_entries(name, tiny_model, story_ids):
    spec = budget_spec(name, BUDGET, PROMPT)
    if spec is None:
        method = REGISTRY[name]
        assert not any(p.type is Budget for p in method.params), f"{name} declares a budget but cannot be sized"
        pytest.skip(f"{name} keeps what its own policy decides (no budget to size)")
    session = PromptSession(tiny_model, story_ids[:PROMPT])
    result, _ = session.run(spec, STEPS, forced_tokens=story_ids[PROMPT:PROMPT + STEPS])
    assert result.error is None, result.error
    entries = result.kv_bytes / result.kv_bytes_full * (PROMPT + STEPS)  # mean entries per layer and head
    assert BUDGET * 0.75 <= entries <= BUDGET + STEPS + 1, f"{spec}: {entries:.1f} entries per head"


def test_overrides_apply_on_top_of_the_budget_and_bad_ones_give_none():
    assert budget_spec("snapkv", 64, kernel=5) == "snapkv:budget=64,kernel=5"
    assert budget_spec("snapkv", 64, kernel=4) is None  # the method refuses an even pooling kernel
    assert budget_spec("kivi", 64) is None and budget_spec("nonexistent", 64) is None
    assert budget_spec("kvpress", 64) is None  # a ratio needs the prompt's length
