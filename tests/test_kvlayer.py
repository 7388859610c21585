"""One cache layer on its own: no model and no owning KVCache, only small random tensors and what the layer is given
(its method, ledger, protected positions, key re-rotation and each step's context)."""

from __future__ import annotations

import torch

from kvviz.cache.kvcache import KVLayer, StepContext
from kvviz.cache.ledger import KEPT, EvictionLedger
from kvviz.cache.protect import protected_positions
from kvviz.cache.protocol import Decode
from kvviz.cache.rotation import KeyRerotation, KeyRotator
from kvviz.cache.storage import DenseStorage
from kvviz.methods import parse_spec

HEADS, DIM = 2, 4


def entries(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, tokens, DIM, generator=generator), torch.randn(1, HEADS, tokens, DIM,
                                                                                 generator=generator)


def layer_holding_prompt(spec: str, prompt: int, protected: torch.Tensor | None = None,
                         rerotation: KeyRerotation | None = None):
    """A layer for ``spec`` (with a ledger) after it held and compressed a ``prompt``-token prompt; its K/V too."""
    ledger = EvictionLedger.empty(1, HEADS, prompt, prompt + 8)
    layer = KVLayer(0, 1, DenseStorage(), parse_spec(spec).eviction, ledger, protected, rerotation)
    keys, values = entries(prompt)
    positions = torch.arange(prompt).expand(1, HEADS, prompt)
    layer.begin_step(StepContext(0, prompt))
    layer.hold_prompt(keys, values, positions, positions)
    return layer, ledger, keys, values


def feed(layer: KVLayer, position: int, step: int, prompt: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one token at ``position`` as decode step ``step`` does; return what attention would read."""
    layer.begin_step(StepContext(step, prompt, torch.tensor([position]), torch.tensor([position]), evicting=True))
    return layer.update(*entries(1, seed))


def test_window_layer_keeps_the_last_window_and_records_each_eviction_with_its_step():
    layer, ledger, keys, _ = layer_holding_prompt("window:window=4", prompt=6)
    assert layer.positions[0].tolist() == [[2, 3, 4, 5]] * HEADS
    assert torch.equal(layer.storage.materialize()[0], keys[:, :, 2:])
    new_keys, _ = entries(1, seed=7)
    attended_keys, _ = feed(layer, position=6, step=1, prompt=6, seed=7)
    assert layer.positions[0].tolist() == [[3, 4, 5, 6]] * HEADS
    assert torch.equal(attended_keys, torch.cat([keys[:, :, 3:], new_keys], 2))  # evicted before attention
    assert ledger.evicted_at[0, :, :7].tolist() == [[0, 0, 1, KEPT, KEPT, KEPT, KEPT]] * HEADS


def test_protected_positions_survive_a_window_layer_and_stay_out_of_the_ledger():
    layer, ledger, _, _ = layer_holding_prompt("window:window=4", prompt=6, protected=protected_positions([(0, 1)]))
    feed(layer, position=6, step=1, prompt=6, seed=1)
    assert layer.positions[0].tolist() == [[0, 3, 4, 5, 6]] * HEADS
    assert ledger.evicted_at[0, :, :3].tolist() == [[KEPT, 0, 1]] * HEADS


def test_prompt_only_method_keeps_every_token_that_arrives_past_its_budget():
    layer, ledger, _, _ = layer_holding_prompt("snapkv:budget=8,window=2", prompt=6)  # the budget covers the prompt
    assert layer.decode is Decode.NEVER
    for step in range(1, 5):
        feed(layer, position=5 + step, step=step, prompt=6, seed=step)
    assert layer.positions[0].tolist() == [list(range(10))] * HEADS
    assert int((ledger.evicted_at != KEPT).sum()) == 0


def test_h2o_layer_holds_one_over_budget_until_attention_then_keeps_the_most_attended_so_far():
    layer, ledger, _, _ = layer_holding_prompt("h2o:heavy=1,recent=2", prompt=3)  # 3 entries: within budget
    feed(layer, position=3, step=1, prompt=3, seed=1)
    assert layer.positions.shape[-1] == 4  # selected after attention, not on append
    layer.select_by_attention(torch.tensor([0.7, 0.05, 0.05, 0.2]).expand(1, 2 * HEADS, 1, 4))
    assert layer.positions[0].tolist() == [[0, 2, 3]] * HEADS  # heavy hitter 0 and the two most recent
    assert ledger.evicted_at[0, :, 1].tolist() == [1] * HEADS
    feed(layer, position=4, step=2, prompt=3, seed=2)
    layer.select_by_attention(torch.tensor([0.0, 0.5, 0.0, 0.5]).expand(1, 2 * HEADS, 1, 4))
    # token 0 got no attention this step but carries the most accumulated: it stays, token 2 goes
    assert layer.positions[0].tolist() == [[0, 3, 4]] * HEADS
    assert ledger.evicted_at[0, :, 2].tolist() == [2] * HEADS


def test_rerotating_layer_moves_kept_keys_to_consecutive_rotary_positions():
    rotator = KeyRotator(torch.tensor([1.0, 0.1]))
    layer, _, keys, _ = layer_holding_prompt("streaming_llm:sinks=1,window=2", prompt=5,
                                             rerotation=KeyRerotation(rotator))
    assert layer.positions[0].tolist() == [[0, 3, 4]] * HEADS
    assert layer.rotary[0].tolist() == [[0, 1, 2]] * HEADS  # rotary positions 3, 4 moved back by 2
    cos, sin = rotator.angles(torch.tensor([-2, -2]), keys.dtype)
    assert torch.allclose(layer.storage.materialize()[0][:, :, 1:], rotator.apply(keys[:, :, 3:], cos, sin))
    assert torch.equal(layer.storage.materialize()[0][:, :, 0], keys[:, :, 0])  # the sink stays where it was


def test_schedules_declare_when_each_method_selects_and_what_its_prefill_records():
    assert parse_spec("window").eviction.schedule.decode is Decode.AFTER_APPEND
    assert parse_spec("window").eviction.schedule.capture is None
    h2o = parse_spec("h2o").eviction.schedule
    assert h2o.decode is Decode.AFTER_ATTENTION and h2o.capture.all_queries
    snapkv = parse_spec("snapkv:window=16").eviction.schedule
    assert snapkv.decode is Decode.NEVER and snapkv.capture.windows == (16,) and not snapkv.capture.all_queries


def local_layer(spec: str, prompt: int, window: int):
    """A local (sliding-window) layer for ``spec`` after it held a ``prompt``-token prompt; its ledger and K/V."""
    ledger = EvictionLedger.empty(1, HEADS, prompt, prompt + 8, windows=(window,))
    layer = KVLayer(0, 1, DenseStorage(), parse_spec(spec).eviction, ledger, window=window)
    keys, values = entries(prompt)
    positions = torch.arange(prompt).expand(1, HEADS, prompt)
    layer.begin_step(StepContext(0, prompt))
    layer.hold_prompt(keys, values, positions, positions)
    return layer, ledger, keys


def test_local_layer_holds_the_next_query_s_window_as_the_model_s_own_cache_does():
    layer, ledger, keys = local_layer("full", prompt=10, window=4)
    assert layer.is_sliding and layer.positions[0].tolist() == [[7, 8, 9]] * HEADS  # window - 1
    new_keys, _ = entries(1, seed=3)
    attended, _ = feed(layer, position=10, step=1, prompt=10, seed=3)
    assert torch.equal(attended, torch.cat([keys[:, :, 7:], new_keys], 2))  # the query at 10 sees 7..10
    assert layer.positions[0].tolist() == [[8, 9, 10]] * HEADS and layer.nbytes().total == 2 * HEADS * 3 * DIM * 4
    assert layer.oldest == 8  # tracked on the host: sliding reads nothing back from a device
    assert ledger.evicted_at[0, 0, :11].tolist() == [0] * 7 + [1, KEPT, KEPT, KEPT]
    assert ledger.slid_out(11).all(dim=1)[0, :8].all() and ledger.layer_kinds() == ["local 4"]


def test_methods_evict_on_global_layers_only_unless_they_select_within_the_window():
    layer, _, _ = local_layer("streaming_llm:sinks=1,window=1,rerotate=0", prompt=10, window=6)
    assert not layer.evicts and layer.positions[0, 0].tolist() == [5, 6, 7, 8, 9]  # its window, not 1 + 1
    layer, ledger, _ = local_layer("window:window=2", prompt=10, window=6)
    assert layer.evicts and layer.positions[0, 0].tolist() == [8, 9] and layer.oldest is None  # read from positions
    assert not ledger.slid_out(10)[0, 0, 5:8].any() and ledger.slid_out(10)[0, 0, :5].all()
    feed(layer, position=10, step=1, prompt=10, seed=1)
    assert layer.positions[0, 0].tolist() == [9, 10]
