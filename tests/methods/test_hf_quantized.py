"""transformers' QuantizedCache layers as a method: bytes from the backend's tensors, clear refusals."""

import importlib.util

import pytest
import torch

import kvviz.methods.hf_quantized as hf
from kvviz.methods import SpecError, parse_spec

HAVE_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto")


@pytest.mark.skipif(not HAVE_QUANTO, reason="optimum-quanto not installed")
def test_quanto_layer_stores_packed_codes_and_re_quantizes_when_the_residual_fills():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    storage = parse_spec("hf_quantized:nbits=4,residual=8").quantization.new_storage(0)
    storage.append(keys[:, :, :32], values[:, :, :32])
    held = storage.nbytes()
    assert held.codes == 2 * 2 * 32 * 64 // 2 and held.full_precision == 0  # the prompt is quantized whole
    for t in range(32, 40):
        storage.append(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    restored, _ = storage.materialize()
    assert len(storage) == 40 and restored.shape == keys.shape
    assert float((restored - keys).norm() / keys.norm()) < 0.12


def test_missing_backend_is_one_line_and_does_not_sink_a_comparison(monkeypatch, tiny_model, story_ids):
    from kvviz.comparison.session import compare

    monkeypatch.setitem(hf.BACKENDS, "quanto", ("kvviz_no_such_backend", "optimum-quanto", (2, 4)))
    with pytest.raises(SpecError, match="needs the 'optimum-quanto' package") as caught:
        parse_spec("hf_quantized").quantization.new_storage(0)
    assert "\n" not in str(caught.value)
    comparison = compare(tiny_model, story_ids[:30], ["hf_quantized"], max_new_tokens=2)
    assert "optimum-quanto" in comparison.by_method("hf_quantized").error
    assert comparison.by_method("full").error is None


def test_refuses_eviction_and_wrong_bits_in_one_line():
    with pytest.raises(SpecError, match="cannot stack with 'random"):
        parse_spec("random:budget=8+hf_quantized")
    with pytest.raises(SpecError, match="quanto takes 2|4"):
        parse_spec("hf_quantized:nbits=8")
    assert parse_spec("hf_quantized:backend=hqq,nbits=8").quantization.nbits == 8
