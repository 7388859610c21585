"""Dense storage: appends joined lazily, evictions fused with them, and in-place key writes that never touch a
tensor the storage did not make."""

import torch

from kvviz.cache.storage import DenseStorage, KeptRanges, gather_tokens, take_ranges


def _entries(length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(start, start + length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 3, length, 4)
    return keys.contiguous(), (keys + 0.5).contiguous()


def test_kept_ranges_name_the_same_entries_as_their_index_and_their_gaps():
    kept = KeptRanges(((0, 4), (7, 10)), batch=1, heads=3)
    assert kept.index().tolist() == [[[0, 1, 2, 3, 7, 8, 9]] * 3]
    assert kept.dropped(12) == ((4, 7), (10, 12)) and KeptRanges(((2, 5),), 1, 1).dropped(5) == ((0, 2),)
    assert torch.equal(take_ranges(torch.arange(12).view(1, 1, 12), kept.spans, -1), kept.index()[:, :1])


def test_keep_after_append_equals_gathering_the_joined_entries():
    sinks_and_window = KeptRanges(((0, 2), (5, 11)), batch=1, heads=3)  # spans the stored and the appended entries
    for kept in (sinks_and_window, torch.tensor([[[0, 3, 9, 10], [1, 2, 4, 10], [0, 5, 6, 7]]])):
        storage = DenseStorage()
        storage.append(*_entries(8))
        storage.append(*_entries(3, start=8))
        joined = torch.cat([_entries(8)[0], _entries(3, start=8)[0]], dim=2)
        assert len(storage) == 11 and storage.nbytes().total == 2 * joined.numel() * 4
        index = kept.index() if isinstance(kept, KeptRanges) else kept
        storage.keep_ranges(kept) if isinstance(kept, KeptRanges) else storage.keep(kept)
        keys, values = storage.materialize()
        assert torch.equal(keys, gather_tokens(joined, index))
        assert torch.equal(values, keys + 0.5)
        assert len(storage) == index.shape[-1]


def test_write_keys_copies_a_tensor_it_does_not_own_and_writes_its_own_in_place():
    shared_keys, shared_values = _entries(6)
    storage = DenseStorage()
    storage.append(shared_keys, shared_values)  # e.g. the prefill cache's tensors, forked by several methods
    storage.write_keys(torch.tensor([0]), torch.full((1, 3, 1, 4), -1.0))
    assert shared_keys[0, 0, 0, 0] == 0 and storage.materialize()[0][0, 0, 0, 0] == -1
    own = storage.materialize()[0]
    storage.write_keys(torch.tensor([1]), torch.full((1, 3, 1, 4), -2.0))
    assert own[0, 0, 1, 0] == -2 and storage.materialize()[0] is own


def test_a_window_slides_over_its_buffers_holding_exactly_its_entries_and_copying_them_rarely():
    for sinks, window in ((0, 6), (4, 6), (2, 1)):  # no sinks; sinks overlapping their next place; a 1-token window
        storage = DenseStorage()
        storage.append(*_entries(20))
        storage.keep_ranges(KeptRanges(((0, sinks), (20 - window, 20)) if sinks else ((20 - window, 20),), 1, 3))
        buffers = set()
        for token in range(20, 220):
            storage.append(*_entries(1, start=token))
            length = len(storage)
            spans = ((0, sinks), (length - window, length)) if sinks else ((length - window, length),)
            storage.keep_ranges(KeptRanges(spans, 1, 3))
            keys, values = storage.materialize()
            expected = list(range(sinks)) + list(range(token + 1 - window, token + 1))
            assert keys[0, 1, :, 0].tolist() == expected and torch.equal(values, keys + 0.5), (sinks, token)
            assert storage.nbytes().total == 2 * keys.numel() * 4
            buffers.add(keys.untyped_storage().data_ptr())
        assert len(buffers) <= 200 // 64 + 1, "the held entries are copied only when the buffers' room runs out"
        storage.keep(torch.tensor([[[0]] * 3]))  # any other keep still works after sliding
        storage.append(*_entries(1, start=220))
        assert storage.materialize()[0][0, 0, :, 0].tolist() == [0 if sinks else 214, 220]


def test_after_a_keep_the_next_append_writes_in_place():
    storage = DenseStorage()
    storage.append(*_entries(12))
    storage.keep(torch.tensor([[[0, 3, 9, 10], [1, 2, 4, 10], [0, 5, 6, 7]]]))  # heads keep different entries
    kept = storage.materialize()[0]
    storage.append(*_entries(1, start=12))
    keys, values = storage.materialize()
    assert keys.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr(), "no copy of the kept entries"
    assert keys[0, :, :, 0].tolist() == [[0, 3, 9, 10, 12], [1, 2, 4, 10, 12], [0, 5, 6, 7, 12]]
    assert torch.equal(values, keys + 0.5)
