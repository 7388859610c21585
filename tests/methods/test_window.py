"""window: exactly the last W tokens at every step; and every policy reproduces full when its budget covers all."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.session import PromptSession, capture_for
from kvviz.methods import SpecError, parse_spec
from kvviz.runtime.replay import forward_step


def step_through(loaded, prompt_ids: list[int], spec: str, steps: int, after_step=None, listeners=()):
    """Prefill, fork ``spec`` and feed ``steps`` greedy tokens one by one; ``after_step(cache, step)`` each step.
    ``listeners`` see the attention of every forward: the prompt's and each step's."""
    session = PromptSession(loaded, prompt_ids)
    stack = parse_spec(spec)
    logits = session.prefill(capture_for([stack]), listeners).last_logits  # the prefill the fork reads
    cache = session.fork(stack)
    if after_step is not None:
        after_step(cache, 0)
    with torch.inference_mode():  # forward_step hands the cache its own attention when its method scores it
        for step in range(1, steps + 1):
            position = len(prompt_ids) + step - 1
            logits = forward_step(loaded.model, cache, [int(logits.argmax())], position, step, loaded.device,
                                  listeners)
            if after_step is not None:
                after_step(cache, step)
    return cache


def prompt(loaded, length: int) -> list[int]:
    ids = loaded.tokenizer("It was the best of times, it was the worst of times, it was the age of wisdom. " * 8)
    return ids["input_ids"][:length]


def test_window_keeps_exactly_the_last_window_at_every_step(tiny_model):
    ids = prompt(tiny_model, 30)

    def check(cache, step):
        seen = len(ids) + step
        expected = list(range(seen - 10, seen))
        kept = cache.ledger.kept_mask(step, seen)
        for layer in range(2):
            assert cache.kept_positions(layer).tolist() == [expected, expected]
            assert torch.nonzero(kept[layer, 0]).flatten().tolist() == expected

    cache = step_through(tiny_model, ids, "window:window=10", 12, check)
    assert cache.ledger.evicted_at[0, 0, :20].tolist() == [0] * 20  # compressed at prefill
    assert cache.ledger.evicted_at[0, 0, 20:22].tolist() == [1, 2]  # then one per step


SPECS_COVERING_EVERYTHING = [
    "window:window=200", "streaming_llm:sinks=4,window=200", "streaming_llm:window=200,rerotate=0",
    "h2o:heavy=100,recent=100", "snapkv:budget=200", "tova:budget=200", "random:budget=200",
    "kvpress:press=knorm,ratio=0",
]


@pytest.mark.parametrize("spec", SPECS_COVERING_EVERYTHING)
def test_any_policy_whose_budget_covers_the_sequence_reproduces_full(tiny_model, spec):
    ids = prompt(tiny_model, 40)
    session = PromptSession(tiny_model, ids)
    full, _ = session.run("full", 24)
    result, _ = session.run(spec, 24)
    assert result.token_ids == full.token_ids
    assert result.ledger is None or bool((result.ledger.evicted_at == -1).all())


@pytest.mark.parametrize("spec, message", [
    ("window:window=0", "bad value in 'window:window=0'"),
    ("window:window=-4", "bad value"),
    ("window:window=abc", "bad value"),
    ("window:window=1.5", "bad value"),
])
def test_bad_window_values_give_one_line(spec, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_spec(spec)
    assert "\n" not in str(caught.value)
