"""kvviz's kvpress wrappers count what kvpress's own functions count: entries kept per head at a ratio
(``compute_n_kept``, what ScorerPress keeps) and PyramidKV's per-layer budgets (``get_layer_budget``), over a grid."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from kvviz.methods import parse_spec

LENGTHS = (1, 2, 5, 63, 64, 65, 100, 257, 1000, 4096)
RATIOS = (0.0, 0.01, 0.1, 0.25, 0.333, 0.5, 0.75, 0.9, 0.99)


def _kvpress_kept(length: int, ratio: float) -> int:
    """What a kvpress ScorerPress keeps per head: all at ratio 0 (it returns the cache untouched), else n_kept."""
    from kvpress.utils import compute_n_kept

    return length if ratio == 0 else compute_n_kept(length, ratio)


@pytest.mark.parametrize("spec", ["kvpress:press=knorm,ratio={r}", "adakv:press=knorm,ratio={r}",
                                  "kvpress_native:press=knorm,compression_ratio={r}"])
def test_kept_per_head_is_kvpress_compute_n_kept(spec):
    for ratio in RATIOS:
        method = parse_spec(spec.format(r=ratio)).eviction
        assert [method.budget_for(n) for n in LENGTHS] == [_kvpress_kept(n, ratio) for n in LENGTHS], ratio


def test_per_layer_keeps_kvpress_count_at_each_layers_ratio():
    ratios = (0.0, 0.1, 0.5, 0.9, 0.99, 0.333)
    method = parse_spec("per_layer:press=knorm,ratios=" + "/".join(map(str, ratios))).eviction
    for length, (layer, ratio) in itertools.product(LENGTHS, enumerate(ratios)):
        assert method.layer_kept(length, layer, len(ratios)) == _kvpress_kept(length, ratio), (length, layer)


def test_pyramidkv_layer_budgets_are_kvpress_pyramidkv_budgets():
    import kvpress

    for ratio, window, beta, layers in itertools.product((0.0, 0.1, 0.5, 0.75, 0.9), (1, 8, 64), (1, 2, 20),
                                                         (1, 2, 30)):
        ours = parse_spec(f"pyramidkv:press=knorm,ratio={ratio},window={window},beta={beta}").eviction
        press = kvpress.PyramidKVPress(compression_ratio=ratio, window_size=window, beta=beta)
        for length, layer in itertools.product((65, 100, 257, 1000, 4096), range(layers)):
            module = SimpleNamespace(layer_idx=layer, config=SimpleNamespace(num_hidden_layers=layers))
            expected = length if ratio == 0 else press.get_layer_budget(module, length)
            assert ours.layer_kept(length, layer, layers) == expected, (ratio, window, beta, layers, length, layer)
