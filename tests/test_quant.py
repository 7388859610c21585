"""Bit packing and group-wise asymmetric quantization primitives."""

import pytest
import torch

from kvviz.cache.quant import (
    channel_groups,
    decode,
    error_bound,
    minmax_params,
    pack,
    packed_width,
    quantize_per_channel,
    quantize_per_token,
    unpack,
)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_round_trips_and_uses_the_packed_width(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 20), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_width(20, bits)
    assert torch.equal(unpack(packed, bits, 20), codes)


def test_pack_refuses_widths_that_do_not_divide_a_byte():
    with pytest.raises(ValueError, match="cannot pack 3-bit"):
        pack(torch.zeros(4, dtype=torch.uint8), 3)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_channel_error_stays_within_half_a_step(bits):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 32, 20) * torch.linspace(0.1, 8, 20)  # channels of very different ranges
    q, restored = quantize_per_channel(x, bits, group=8, dtype=x.dtype)
    assert q.scale.shape == (1, 2, 4, 20) and q.scale.dtype == torch.float16
    scale, zero = (t.repeat_interleave(8, dim=2) for t in (q.scale, q.zero))
    assert torch.equal(restored, decode(unpack(q.codes, bits, 20), scale, zero, x.dtype)), "what the packed codes say"
    bound = error_bound(q.scale, q.zero, bits).repeat_interleave(8, dim=2)
    assert bool(((restored - x).abs() <= bound).all())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_token_error_stays_within_half_a_step_with_a_short_last_group(bits):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 7, 20)
    q, restored = quantize_per_token(x, bits, group=8, dtype=x.dtype)
    assert q.scale.shape == (1, 2, 7, 3)  # channel groups 8 + 8 + 4
    groups = channel_groups(20, 8)
    assert torch.equal(restored, decode(unpack(q.codes, bits, 20), q.scale[..., groups], q.zero[..., groups], x.dtype))
    bound = error_bound(q.scale, q.zero, bits)[..., torch.arange(20) // 8]
    assert bool(((restored - x).abs() <= bound).all())


@pytest.mark.parametrize(("dim", "group"), [(64, 32), (64, 128), (20, 8), (96, 64)])
def test_per_token_groups_take_each_groups_own_minimum_and_maximum(dim, group):
    torch.manual_seed(2)
    x = torch.randn(1, 3, 5, dim)
    q, _ = quantize_per_token(x, 2, group)
    width = min(group, dim)
    for number, start in enumerate(range(0, dim, width)):
        lo, hi = x[..., start:start + width].amin(-1), x[..., start:start + width].amax(-1)
        scale, zero = minmax_params(lo, hi, 2)
        assert torch.equal(q.scale[..., number], scale) and torch.equal(q.zero[..., number], zero)


def test_constant_groups_decode_exactly():
    x = torch.full((1, 1, 8, 4), 0.5)
    _, restored = quantize_per_channel(x, 2, group=8, dtype=x.dtype)
    assert torch.equal(restored, x)
