"""The per-token baseline: same storage as KIVI, keys grouped per token, hurt by outlier key channels."""

import torch

from kvviz.cache.quant import error_bound
from kvviz.methods import parse_spec


def _keys_with_outlier_channels(length=64, heads=2, dim=32):
    torch.manual_seed(0)
    keys = torch.randn(1, heads, length, dim)
    keys[..., 3] = 20 + keys[..., 3]  # one large channel, as real keys have
    return keys, torch.randn(1, heads, length, dim)


def _store(spec, keys, values):
    storage = parse_spec(spec).quantization.new_storage(0)
    storage.append(keys, values)
    return storage


def test_per_token_keys_have_one_scale_per_token_and_channel_group():
    keys, values = _keys_with_outlier_channels()
    storage = _store("per_token:bits=2,group=16,residual=0", keys, values)
    assert storage.keys.scale.shape == (1, 2, 64, 2) and storage.group_sizes is None
    restored, _ = storage.materialize()
    bound = error_bound(storage.keys.scale, storage.keys.zero, 2)[..., torch.arange(32) // 16]
    assert bool(((restored - keys).abs() <= bound).all())


def test_outlier_channels_make_per_token_keys_worse_than_kivi():
    keys, values = _keys_with_outlier_channels()
    errors = {}
    for name in ("kivi", "per_token"):
        restored, restored_values = _store(f"{name}:bits=2,group=16,residual=0", keys, values).materialize()
        errors[name] = float((restored - keys).norm() / keys.norm())
        assert float((restored_values - values).norm() / values.norm()) < 0.5  # values are stored alike
    assert errors["per_token"] > 3 * errors["kivi"]


def test_per_token_bits_per_element_counts_key_metadata_per_token():
    assert parse_spec("per_token:bits=2").quantization.bits_per_element(64) == 3.0  # 2 + 32 bits / 32 channels
    assert parse_spec("per_token:bits=4,group=16").quantization.bits_per_element(64) == 6.0
