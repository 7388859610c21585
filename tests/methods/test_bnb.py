"""bitsandbytes blockwise K/V: reconstruction per type, exact bytes, eviction as a gather."""

import pytest
import torch

from kvviz.methods import parse_spec


def _kv(length=40, heads=3, dim=64):
    torch.manual_seed(0)
    return torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim) + 0.5


@pytest.mark.parametrize("kind, bound", [("nf4", 0.12), ("fp4", 0.16), ("int8", 0.015)])
def test_reconstruction_error_per_type(kind, bound):
    keys, values = _kv()
    storage = parse_spec(f"bnb:type={kind}").quantization.new_storage(0)
    storage.append(keys[:, :, :30], values[:, :, :30])
    for t in range(30, 40):
        storage.append(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    restored_keys, restored_values = storage.materialize()
    assert restored_keys.shape == keys.shape and len(storage) == 40
    assert float((restored_keys - keys).norm() / keys.norm()) < bound
    assert float((restored_values - values).norm() / values.norm()) < bound


def test_bytes_count_codes_and_one_fp32_absmax_per_token_and_head():
    keys, values = _kv(length=10, heads=2, dim=16)  # 16 channels pad to one 64-element block
    for kind, row_bytes in (("nf4", 32), ("int8", 64)):
        method = parse_spec(f"bnb:type={kind}").quantization
        storage = method.new_storage(0)
        storage.append(keys, values)
        held = storage.nbytes()
        assert (held.codes, held.metadata, held.full_precision) == (2 * 2 * 10 * row_bytes, 2 * 2 * 10 * 4, 0)
        assert method.bits_per_element(16) == (row_bytes * 8 + 32) / 16


def test_eviction_is_a_gather_of_codes_and_absmax():
    keys, values = _kv()
    storage = parse_spec("bnb").quantization.new_storage(0)
    storage.append(keys, values)
    before_keys, before_values = storage.materialize()
    index = torch.stack([torch.randperm(40)[:12].sort().values for _ in range(3)]).unsqueeze(0)
    storage.keep(index)
    expand = index.unsqueeze(-1).expand(-1, -1, -1, 64)
    assert torch.equal(storage.materialize()[0], before_keys.gather(2, expand))
    assert torch.equal(storage.materialize()[1], before_values.gather(2, expand))
    assert storage.nbytes().total == 2 * 3 * 12 * (32 + 4)


def test_bnb_decodes_on_the_tiny_model(tiny_model, story_ids):
    from kvviz.comparison.session import compare

    comparison = compare(tiny_model, story_ids[:40], ["bnb:type=int8"], max_new_tokens=4)
    result = comparison.by_method("bnb:type=int8")
    assert result.error is None and len(result.token_ids) == 4
    assert result.kv_breakdown.codes > 0 and result.kv_breakdown.full_precision == 0
