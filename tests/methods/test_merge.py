"""merge: SnapKV's selection with every evicted token folded into its most similar kept key, at snapkv's bytes."""

from __future__ import annotations

import torch

from kvviz.comparison.session import PromptSession
from kvviz.methods import parse_spec
from kvviz.methods.kvpress.fork import _merge_targets
from kvviz.methods.merge import merge_into_nearest, nearest_survivor
from tests.methods.test_window import prompt


def test_evicted_entries_fold_into_the_most_similar_kept_key_weighted_by_attention():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 0.9]]).view(1, 1, 4, 2)
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0]]).view(1, 1, 4, 1).expand(-1, -1, -1, 2).contiguous()
    weights = torch.tensor([[[1.0, 1.0, 3.0, 0.0]]])
    merged_keys, merged_values = merge_into_nearest(keys, values, torch.tensor([[[0, 1]]]), weights)
    assert torch.allclose(merged_values[0, 0, :, 0], torch.tensor([(1 + 3 * 3) / 4, 2.0]), atol=1e-4)  # 3 -> 0
    assert torch.allclose(merged_keys[0, 0, 0], torch.tensor([(1 + 3 * 0.9) / 4, 0.3 / 4]), atol=1e-4)
    assert torch.allclose(merged_keys[0, 0, 1], keys[0, 0, 1], atol=1e-4)  # entry 3 weighs almost nothing


def test_an_evicted_token_goes_to_the_survivor_pointing_its_way_not_the_closest_one():
    """One rule for merge's folds and for reading a kvpress merging press: cosine similarity of keys, not distance."""
    keys = torch.tensor([[10.0, 0.0], [0.5, 0.6], [1.0, 0.1], [0.1, 1.0]]).view(1, 1, 4, 2)
    assert nearest_survivor(keys[0, 0, 2:], keys[0, 0, :2]).tolist() == [0, 1]  # (1, 0.1) is nearer (0.5, 0.6)
    targets = _merge_targets(keys, torch.tensor([[[0, 1]]]), torch.tensor([[[True, True]]]), 4)
    assert targets.tolist() == [[-1, -1, 0, 1]]


def test_same_entries_and_bytes_as_snapkv_but_merged_contents(tiny_model):
    session = PromptSession(tiny_model, prompt(tiny_model, 60))
    merged = session.fork(parse_spec("merge:budget=20,window=8"))
    plain = session.fork(parse_spec("snapkv:budget=20,window=8"))
    for layer in range(2):
        assert torch.equal(merged.kept_positions(layer), plain.kept_positions(layer))
        assert not torch.allclose(merged.layers[layer].storage.materialize()[1],
                                  plain.layers[layer].storage.materialize()[1])
    assert merged.nbytes().total == plain.nbytes().total == 2 * 2 * 20 * 2 * 16 * 4
    assert torch.equal(merged.ledger.evicted_at, plain.ledger.evicted_at)


def test_merged_entries_are_stored_in_the_stacks_format(tiny_model):
    session = PromptSession(tiny_model, prompt(tiny_model, 60))
    result, _ = session.run("merge:budget=20,window=8+fp8", 3)
    assert result.error is None
    assert result.kv_breakdown.codes == 2 * 2 * (20 + 2) * 2 * 16  # one byte per element
    stacked, _ = session.run("merge:budget=20,window=8+kivi:group=8,residual=8", 3)
    assert stacked.error is None and stacked.kv_breakdown.codes > 0
