"""tova: over budget, drop the entry the newest query attends to least (mean over the layer's heads)."""

from __future__ import annotations

import torch

from kvviz.methods import parse_spec
from tests.methods.test_window import prompt, step_through


class LastAttention:
    """Keeps the probabilities each layer's newest query gave, with the positions they were over."""

    def __init__(self):
        self.cache = None
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def wants(self, layer_idx: int) -> bool:
        return self.cache is not None

    def observe(self, layer_idx, probs, query_start, query_total):
        positions = self.cache.layers[layer_idx].positions[0, 0].clone()
        self.seen[layer_idx] = (probs[0, :, -1].mean(0).clone(), positions)


def test_drops_the_least_attended_entry_each_step(tiny_model):
    ids = prompt(tiny_model, 30)
    spy = LastAttention()

    def check(cache, step):
        spy.cache = cache
        for layer in range(2):
            kept = cache.kept_positions(layer)
            assert kept.shape == (2, 12) and torch.equal(kept[0], kept[1])  # one ranking per layer
            if step:
                scores, before = spy.seen[layer]
                dropped = set(before.tolist()) - set(kept[0].tolist())
                assert dropped == {int(before[scores.argmin()])}

    cache = step_through(tiny_model, ids, "tova:budget=12", 8, check, [spy])
    assert int((cache.ledger.evicted_at[:, :, :38] > 0).sum()) == 2 * 2 * 8  # one per step, layer and head


def test_prefill_keeps_the_last_querys_favourites(tiny_model):
    from kvviz.comparison.session import PromptSession

    ids = prompt(tiny_model, 30)
    session = PromptSession(tiny_model, ids)
    cache = session.fork(parse_spec("tova:budget=0.5"))
    last = session.prefill().stats.window_attention[1]
    for layer in range(2):
        expected = last[layer].mean(0).topk(15).indices.sort().values
        assert cache.kept_positions(layer)[0].tolist() == expected.tolist()
