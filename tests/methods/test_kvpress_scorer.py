"""kvpress: a ScorerPress's own score, kvviz's top-k and ledger."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from kvviz.methods.kvpress.scorer import PRESSES
from tests.methods.test_window import prompt


def test_knorm_keeps_the_smallest_key_norms_and_the_ledger_records_the_rest(tiny_model):
    ids = prompt(tiny_model, 40)
    session = PromptSession(tiny_model, ids)
    dense = session.prefill().cache
    cache = session.fork(parse_spec("kvpress:press=knorm,ratio=0.25"))
    for layer in range(2):
        keys, _ = dense.layers[layer].storage.materialize()
        expected = (-keys[0].norm(dim=-1)).topk(30).indices.sort().values
        assert cache.kept_positions(layer).tolist() == expected.tolist()
        evicted = torch.nonzero(cache.ledger.evicted_at[layer, 0, :40] == 0).flatten()
        assert sorted(evicted.tolist() + expected[0].tolist()) == list(range(40))


@pytest.mark.parametrize("press", sorted(PRESSES))
def test_every_listed_press_scores_through_kvviz(tiny_model, press):
    ids = prompt(tiny_model, 80)
    result, _ = PromptSession(tiny_model, ids).run(f"kvpress:press={press},ratio=0.5", 3)
    assert result.ledger.kept_mask(0, 80).sum(-1).tolist() == [[40, 40], [40, 40]]


def test_unknown_press_lists_the_valid_ones():
    with pytest.raises(SpecError, match="choose snapkv|knorm") as caught:
        parse_spec("kvpress:press=nope")
    assert "expected_attention" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("spec", ["kvpress:ratio=1", "kvpress:ratio=-0.1", "kvpress:ratio=x"])
def test_bad_ratios(spec):
    with pytest.raises(SpecError, match="bad value"):
        parse_spec(spec)


def test_snapkv_press_needs_a_prompt_longer_than_its_window(tiny_model):
    with pytest.raises(SpecError, match="longer than its 64-token window"):
        PromptSession(tiny_model, prompt(tiny_model, 40)).fork(parse_spec("kvpress:press=snapkv"))
