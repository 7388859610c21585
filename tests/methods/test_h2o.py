"""h2o: scores are attention accumulated per KV head over every query, kept = recent window + top heavy hitters."""

from __future__ import annotations

import pytest
import torch

from kvviz.methods import SpecError, parse_spec
from tests.methods.test_window import prompt, step_through

HEAVY, RECENT = 5, 4


class Accumulator:
    """Independent bookkeeping: every attention probability any query gives, summed per (layer, KV head, position)."""

    def __init__(self, kv_heads: int, length: int):
        self.kv_heads = kv_heads
        self.total = torch.zeros(2, kv_heads, length, dtype=torch.float64)
        self.cache = None  # set once the forked cache exists: decode probabilities index its entries

    def wants(self, layer_idx: int) -> bool:
        return True

    def observe(self, layer_idx, probs, query_start, query_total):
        received = probs[0].double().sum(1)  # [H_q, K]
        per_kv = received.view(self.kv_heads, -1, received.shape[-1]).sum(1)
        if self.cache is None:  # prefill: keys are positions 0..K-1
            self.total[layer_idx, :, : per_kv.shape[-1]] += per_kv
        else:
            self.total[layer_idx].scatter_add_(1, self.cache.layers[layer_idx].positions[0], per_kv)


def test_scores_equal_independently_accumulated_attention_and_kept_set_is_heavy_plus_recent(tiny_model):
    ids = prompt(tiny_model, 24)
    steps = 10
    accumulator = Accumulator(2, len(ids) + steps)

    def check(cache, step):
        accumulator.cache = cache
        seen = len(ids) + step
        for layer in range(2):
            layer_cache = cache.layers[layer]
            positions = layer_cache.positions[0]
            expected_scores = accumulator.total[layer].gather(1, positions)
            torch.testing.assert_close(layer_cache.state.scores[0].double(), expected_scores, rtol=1e-5, atol=1e-6)
            for head in range(2):
                candidates = list(range(seen)) if step == 0 else previous["kept"][layer][head] + [seen - 1]
                recent = candidates[-RECENT:]
                rest = torch.tensor(candidates[:-RECENT])
                heavy = rest[accumulator.total[layer, head, rest].topk(HEAVY).indices].tolist()
                assert positions[head].tolist() == sorted(recent + heavy)
        previous["kept"] = [[cache.layers[i].positions[0, h].tolist() for h in range(2)] for i in range(2)]

    previous: dict = {}
    cache = step_through(tiny_model, ids, f"h2o:heavy={HEAVY},recent={RECENT}", steps, check, [accumulator])
    assert cache.layers[0].positions.shape[-1] == HEAVY + RECENT
    assert int((cache.ledger.evicted_at[0, 0, : len(ids)] == 0).sum()) == len(ids) - HEAVY - RECENT


def test_ratios_follow_the_current_length(tiny_model):
    ids = prompt(tiny_model, 40)

    sizes = []

    def check(cache, step):
        seen = len(ids) + step
        budget = 2 * -(-seen // 10)  # ceil(0.1 * seen) heavy + the same recent
        size = cache.layers[0].positions.shape[-1]
        assert size == (budget if step == 0 else min(sizes[-1] + 1, budget))
        sizes.append(size)

    step_through(tiny_model, ids, "h2o", 12, check)
    assert sizes[0] == 8 and sizes[-1] == 12  # the cache grows with the sequence


def test_defaults_are_the_papers_20_percent():
    method = parse_spec("h2o").eviction
    assert (method.heavy.value, method.recent.value) == (0.1, 0.1)
    assert method.budget_for(1000) == 200


def test_bad_values_give_one_line():
    with pytest.raises(SpecError, match="bad value in 'h2o:heavy=-1'"):
        parse_spec("h2o:heavy=-1")


def test_carried_scores_follow_positions_when_decoding_and_when_the_cache_kept_more():
    from kvviz.methods.h2o import H2OState

    state = H2OState(torch.tensor([[[1.0, 2.0, 3.0]]]), torch.tensor([[[0, 2, 5]]]))
    decoding = state.carried(torch.tensor([[[0, 2, 5, 6]]]))  # what H2O kept, then the new token
    assert decoding.tolist() == [[[1.0, 2.0, 3.0, 0.0]]]
    protected = state.carried(torch.tensor([[[0, 1, 2, 5, 6]]]))  # a protected span kept position 1 as well
    assert protected.tolist() == [[[1.0, 0.0, 2.0, 3.0, 0.0]]]


def test_one_over_the_budget_drops_each_heads_lowest_as_topk_would():
    from kvviz.cache.protocol import topk_keep

    torch.manual_seed(0)
    scores = torch.rand(2, 3, 9)
    forced = torch.zeros(9, dtype=torch.bool)
    forced[-2:] = True
    kept = topk_keep(scores, 8, forced)
    expected = scores.masked_fill(forced, float("inf")).topk(8, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(kept, expected)
