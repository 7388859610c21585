"""fp8: float8 codes with dynamic amax scales, exact bytes, eviction as a gather, stacking with eviction."""

from __future__ import annotations

import pytest
import torch

from kvviz.comparison.diagnostics import reconstruction_error
from kvviz.comparison.session import PromptSession
from kvviz.methods import SpecError, parse_spec
from tests.methods.test_window import prompt


def _kv(length=40, heads=3, dim=64):
    torch.manual_seed(0)
    return torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim) * 3 + 0.5


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_codes_are_torch_float8_and_e4m3_is_the_more_precise(fmt, dtype):
    keys, values = _kv()
    storage = parse_spec(f"fp8:format={fmt},scale=head").quantization.new_storage(0)
    storage.append(keys, values)
    assert storage.codes[0].dtype == dtype and storage.codes[0].element_size() == 1
    restored, _ = storage.materialize()
    error = float((restored - keys).norm() / keys.norm())
    assert error < (0.04 if fmt == "e4m3" else 0.08)
    assert error > 0  # it does quantize


def test_dynamic_scale_is_amax_over_the_formats_max():
    keys, values = _kv()
    keys[0, 1] *= 10  # one loud head
    for granularity, shape in (("tensor", (1, 1, 1, 1)), ("head", (1, 3, 1, 1)), ("token", (1, 3, 40, 1))):
        storage = parse_spec(f"fp8:scale={granularity}").quantization.new_storage(0)
        storage.append(keys, values)
        scale = storage.scales[0]
        assert scale.shape == shape
        dims = {"tensor": (1, 2, 3), "head": (2, 3), "token": (3,)}[granularity]
        assert torch.allclose(scale, keys.abs().amax(dim=dims, keepdim=True) / 448.0)
    quiet_head_error = {}
    for granularity in ("tensor", "head"):
        storage = parse_spec(f"fp8:scale={granularity}").quantization.new_storage(0)
        storage.append(keys, values)
        restored, _ = storage.materialize()
        quiet_head_error[granularity] = float((restored[0, 0] - keys[0, 0]).abs().max())
    assert quiet_head_error["head"] <= quiet_head_error["tensor"]  # a per-head scale serves the quiet heads better


def test_tensor_scale_is_fixed_by_the_prompt_and_later_outliers_saturate():
    keys, values = _kv()
    storage = parse_spec("fp8").quantization.new_storage(0)
    storage.append(keys[:, :, :30], values[:, :, :30])
    first = storage.scales[0].clone()
    loud = torch.full_like(keys[:, :, :1], 1000.0)
    storage.append(loud, values[:, :, 30:31])
    assert torch.equal(storage.scales[0], first)
    restored, _ = storage.materialize()
    assert float(restored[:, :, 30].max()) == pytest.approx(float(first.flatten()[0]) * 448.0, rel=1e-5)


@pytest.mark.parametrize("granularity, scales", [("tensor", 1), ("head", 3), ("token", 3 * 40)])
def test_bytes_are_a_quarter_of_float32_plus_the_scales(granularity, scales):
    keys, values = _kv()
    storage = parse_spec(f"fp8:scale={granularity}").quantization.new_storage(0)
    storage.append(keys, values)
    held = storage.nbytes()
    full = 2 * keys.numel() * 4
    assert held.codes == full // 4
    assert held.metadata == 2 * scales * 4
    assert held.full_precision == 0


def test_eviction_gathers_codes_and_token_scales():
    keys, values = _kv()
    storage = parse_spec("fp8:scale=token").quantization.new_storage(0)
    storage.append(keys, values)
    before, _ = storage.materialize()
    index = torch.tensor([[[0, 5, 7], [1, 2, 39], [10, 20, 30]]])
    storage.keep(index)
    after, _ = storage.materialize()
    assert len(storage) == 3 and storage.scales[0].shape == (1, 3, 3, 1)
    assert torch.equal(after, before.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 64)))
    assert storage.nbytes().codes == 2 * 3 * 3 * 64


def test_stacks_with_eviction_and_bytes_follow_the_kept_tokens(tiny_model):
    ids = prompt(tiny_model, 60)
    session = PromptSession(tiny_model, ids)
    result, cache = session.run("snapkv:budget=20,window=8+fp8:scale=head", 4)
    assert result.error is None
    layers, heads, dim = 2, 2, 16
    tokens = 20 + 3  # the budget plus the fed tokens (the last generated one never enters)
    assert result.kv_breakdown.codes == layers * 2 * heads * tokens * dim
    assert result.kv_breakdown.metadata == layers * 2 * heads * 4
    assert result.kv_breakdown.full_precision == 0


def test_reconstruction_error_diagnostics_rank_the_formats(real_model, story_ids):
    from kvviz.comparison.diagnostics import prefill_kv

    kv = prefill_kv(PromptSession(real_model, story_ids[:120]))
    e4m3 = reconstruction_error(kv, "fp8:format=e4m3,scale=token")
    e5m2 = reconstruction_error(kv, "fp8:format=e5m2,scale=token")
    assert len(e4m3.key) == 30 and e4m3.quantized_tokens[0] == 120
    assert max(e4m3.key) < 0.05 and sum(e4m3.value) < sum(e5m2.value)


def test_rerotation_is_refused():
    with pytest.raises(SpecError, match="use rerotate=0"):
        parse_spec("streaming_llm:rerotate=1+fp8")
