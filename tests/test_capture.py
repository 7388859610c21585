"""The registered attention function: same outputs as SDPA, statistics in O(layers * heads * N)."""

import pytest
import torch

from kvviz.cache.capture import CaptureConfig
from kvviz.cache.stats import StatsRecorder


def _forward(model, ids, *listeners):
    """The model's logits over ``ids``; ``listeners`` go with the call to every layer's attention."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), listeners=listeners).logits


def test_capture_returns_the_same_logits_as_sdpa(tiny_model, story_ids):
    plain = _forward(tiny_model.model, story_ids[:120])
    recorder = StatsRecorder(CaptureConfig(), 120)
    captured = _forward(tiny_model.model, story_ids[:120], recorder)
    torch.testing.assert_close(captured, plain, atol=1e-4, rtol=1e-4)


def test_attention_rows_sum_to_one_and_key_scores_add_up(tiny_model, story_ids):
    n = 64
    recorder = StatsRecorder(CaptureConfig(sink_tokens=4, matrices=[(1, 2)], matrix_size=n), n)
    _forward(tiny_model.model, story_ids[:n], recorder)
    stats = recorder.finish()
    assert set(stats.key_attention) == {0, 1}
    for layer in (0, 1):
        # each of the n queries spreads exactly 1.0 of attention over the keys
        torch.testing.assert_close(stats.key_attention[layer].sum(dim=1), torch.full((4,), float(n)))
        assert stats.sink_mass[layer].shape == (4, n)
    matrix = stats.matrices[(1, 2)]
    assert matrix.shape == (n, n)
    torch.testing.assert_close(matrix.sum(dim=1), torch.ones(n))
    assert torch.all(matrix.triu(diagonal=1) == 0), "causal: no attention to future tokens"
    torch.testing.assert_close(stats.key_attention[1][2], matrix.sum(dim=0), atol=1e-4, rtol=1e-4)


def test_matrices_are_downsampled_for_long_prompts(tiny_model, story_ids):
    n = len(story_ids)
    recorder = StatsRecorder(CaptureConfig(matrices=[(0, 0)], matrix_size=32), n)
    _forward(tiny_model.model, story_ids, recorder)
    matrix = recorder.finish().matrices[(0, 0)]
    assert matrix.shape == (32, 32)
    torch.testing.assert_close(matrix.sum(dim=1), torch.ones(32), atol=1e-4, rtol=1e-4)


def test_statistics_memory_grows_linearly(tiny_model, story_ids):
    sizes = []
    for n in (100, 200, 400):
        ids = (story_ids * 3)[:n]
        recorder = StatsRecorder(CaptureConfig(windows=(16,)), n)
        _forward(tiny_model.model, ids, recorder)
        sizes.append(recorder.finish().nbytes())
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 2 * sizes[1]


def test_window_attention_sums_the_last_queries(tiny_model, story_ids):
    n = 48
    recorder = StatsRecorder(CaptureConfig(matrices=[(0, 1)], matrix_size=n, windows=(8,)), n)
    _forward(tiny_model.model, story_ids[:n], recorder)
    stats = recorder.finish()
    expected = stats.matrices[(0, 1)][-8:].sum(dim=0)
    torch.testing.assert_close(stats.window_attention[8][0][1], expected, atol=1e-5, rtol=1e-5)


def test_window_only_capture_computes_just_the_window_rows_and_matches_the_full_capture(tiny_model, story_ids,
                                                                                       monkeypatch):
    from kvviz.cache import attention

    n, computed = 96, []
    explicit = attention._explicit_attention

    def counting(*args, first_query=0, **kwargs):
        computed.append(args[1].shape[2] - first_query)
        return explicit(*args, first_query=first_query, **kwargs)

    full = StatsRecorder(CaptureConfig(windows=(4, 16)), n)
    _forward(tiny_model.model, story_ids[:n], full)
    monkeypatch.setattr(attention, "_explicit_attention", counting)
    windows_only = StatsRecorder(CaptureConfig(windows=(4, 16), all_queries=False), n)
    logits = _forward(tiny_model.model, story_ids[:n], windows_only)
    assert computed == [16, 16]  # per layer: the longest window's queries, not all 96
    torch.testing.assert_close(logits, _forward(tiny_model.model, story_ids[:n]))
    ours, reference = windows_only.finish(), full.finish()
    assert not ours.key_attention and not ours.sink_mass
    for window in (4, 16):
        for layer in (0, 1):
            torch.testing.assert_close(ours.window_attention[window][layer], reference.window_attention[window][layer])


def test_sink_mass_is_strong_on_the_real_model(real_model, story_ids):
    recorder = StatsRecorder(CaptureConfig(sink_tokens=1), len(story_ids))
    _forward(real_model.model, story_ids, recorder)
    per_layer = recorder.finish().sink_mass_per_layer()
    assert len(per_layer) == 30
    assert max(per_layer[12:]) > 0.3, "deep layers of SmolLM2 put much of their attention on token 0"


def test_each_method_asks_for_only_the_capture_it_reads():
    from kvviz.comparison.session import capture_for
    from kvviz.methods import parse_spec

    def wanted(*specs):
        return capture_for([parse_spec(s) for s in specs])

    assert wanted("full", "streaming_llm", "kivi") is None
    snapkv = wanted("snapkv:window=32", "tova")
    assert snapkv.windows == (1, 32) and not snapkv.all_queries and not snapkv.layer_inputs
    assert wanted("snapkv", "h2o").all_queries  # H2O reads attention received from every query
    press = wanted("kvpress:press=knorm")
    assert press.layer_inputs and not press.all_queries and press.windows == ()



def test_a_united_capture_covers_each_need_and_a_narrower_one_does_not():
    windows = CaptureConfig(windows=(32,), all_queries=False)
    inputs = CaptureConfig(layer_inputs=True, all_queries=False)
    matrix = CaptureConfig(matrices=[(3, 0)], received_layers=(3,))
    united = CaptureConfig.uniting([windows, None, inputs, matrix])
    assert all(united.covers(need) for need in (windows, inputs, matrix, None))
    assert united.windows == (32,) and united.layer_inputs and united.all_queries and united.received_layers == (3,)
    assert not windows.covers(inputs) and not inputs.covers(windows)
    assert not matrix.covers(CaptureConfig(received_layers=(4,)))  # another layer's received attention
    assert not windows.covers(CaptureConfig(windows=(32,), all_queries=False, sink_tokens=8))
    assert CaptureConfig.uniting([None, None]) is None

def test_layers_without_received_attention_run_sdpa_and_still_report_exact_sink_mass(tiny_model, story_ids,
                                                                                     monkeypatch):
    from kvviz.cache import attention

    n, explicit_layers = 80, []
    explicit = attention._explicit_attention

    def counting(module, *args, first_query=0, **kwargs):
        if first_query == 0:
            explicit_layers.append(module.layer_idx)
        return explicit(module, *args, first_query=first_query, **kwargs)

    every = StatsRecorder(CaptureConfig(sink_tokens=3), n)
    _forward(tiny_model.model, story_ids[:n], every)
    monkeypatch.setattr(attention, "_explicit_attention", counting)
    one_layer = StatsRecorder(CaptureConfig(sink_tokens=3, received_layers=(1,)), n)
    logits = _forward(tiny_model.model, story_ids[:n], one_layer)
    assert explicit_layers == [1]
    torch.testing.assert_close(logits, _forward(tiny_model.model, story_ids[:n]), atol=1e-5, rtol=1e-5)
    ours, reference = one_layer.finish(), every.finish()
    assert set(ours.key_attention) == {1}
    torch.testing.assert_close(ours.key_attention[1], reference.key_attention[1])
    for layer in (0, 1):
        torch.testing.assert_close(ours.sink_mass[layer], reference.sink_mass[layer], atol=1e-5, rtol=1e-5)
    assert ours.sink_mass_per_layer() == pytest.approx(reference.sink_mass_per_layer(), abs=1e-5)
    held = ours.sink_mass[0]
    assert held.untyped_storage().nbytes() == held.numel() * 4, "must not keep the layer's attention output alive"


def test_masked_grouped_attention_on_cpu_equals_transformers_sdpa():
    """kvviz lets the CPU kernel group query heads over a masked cache; transformers would copy each KV head."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvviz.cache.attention import _sdpa

    torch.manual_seed(0)
    query, key, value = torch.randn(3, 6, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., :25] = False  # a padded row
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, layer_idx=0)
    ours, _ = _sdpa(module, query, key, value, mask, 0.25, 0.0)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25, dropout=0.0)
    assert torch.allclose(ours, theirs, atol=1e-6)
