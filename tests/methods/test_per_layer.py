"""per_layer: a user-given compression ratio per layer, interpolated when fewer values than layers."""

from __future__ import annotations

import pytest

from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from kvviz.methods.kvpress.per_layer import layer_ratio
from tests.methods.test_window import prompt


def test_each_layer_keeps_its_own_count_of_smallest_key_norms(tiny_model):
    ids = prompt(tiny_model, 40)
    session = PromptSession(tiny_model, ids)
    dense = session.prefill().cache
    cache = session.fork(parse_spec("per_layer:press=knorm,ratios=0.25/0.75"))
    for layer, count in ((0, 30), (1, 10)):
        keys, _ = dense.layers[layer].storage.materialize()
        expected = (-keys[0].norm(dim=-1)).topk(count).indices.sort().values
        assert cache.kept_positions(layer).tolist() == expected.tolist()


def test_fewer_ratios_than_layers_are_spread_linearly():
    assert [round(layer_ratio((0.2, 0.8), i, 4), 6) for i in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert [layer_ratio((0.5,), i, 3) for i in range(3)] == [0.5, 0.5, 0.5]
    assert [layer_ratio((0.1, 0.2, 0.3), i, 3) for i in range(3)] == [0.1, 0.2, 0.3]


def test_bytes_are_kept_tokens_times_per_token_bytes(tiny_model):
    result, _ = PromptSession(tiny_model, prompt(tiny_model, 40)).run("per_layer:press=knorm,ratios=0.25/0.75", 1)
    assert result.kv_bytes == (30 + 10) * 2 * 2 * 16 * 4  # (layer 0 + layer 1) x heads x K,V x dim x fp32


@pytest.mark.parametrize("ratios", ["", "0.2/x", "1.5", "0.2//0.3"])
def test_bad_ratios_give_one_line(ratios):
    with pytest.raises(SpecError, match="ratios in") as caught:
        parse_spec(f"per_layer:ratios={ratios}" if ratios else "per_layer:ratios=/")
    assert "\n" not in str(caught.value)


def test_more_ratios_than_layers_are_refused(tiny_model):
    with pytest.raises(SpecError, match="gives 3 ratios; the model has 2 layers"):
        PromptSession(tiny_model, prompt(tiny_model, 40)).fork(parse_spec("per_layer:press=knorm,ratios=.1/.2/.3"))
