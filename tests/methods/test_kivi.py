"""KIVI storage: reconstruction bounds, residual flushing, eviction inside groups, exact bytes, the real model."""

import pytest
import torch

import kvviz.methods.kivi as kivi_module
from kvviz.cache.quant import error_bound
from kvviz.methods import EvictionMethod, MethodStack, SpecError, parse_spec


def _kv(length, heads=2, dim=20, seed=0):
    torch.manual_seed(seed)
    keys = torch.randn(1, heads, length, dim) * torch.linspace(0.2, 6, dim)  # outlier-ish channels
    return keys, torch.randn(1, heads, length, dim)


def _storage(spec):
    return parse_spec(spec).quantization.new_storage(0)


def test_bits8_reconstructs_tightly_and_residual_is_exact():
    keys, values = _kv(100)
    storage = _storage("kivi:bits=8,group=8,residual=10")
    storage.append(keys, values)
    restored_keys, restored_values = storage.materialize()
    assert storage.quantized_length == 88 and storage.residual_length == 12
    assert float((restored_keys - keys).norm() / keys.norm()) < 0.005
    assert float((restored_values - values).norm() / values.norm()) < 0.005
    assert torch.equal(restored_keys[:, :, 88:], keys[:, :, 88:])


@pytest.mark.parametrize("bits", [2, 4])
def test_low_bits_stay_within_half_a_step_of_each_group(bits):
    keys, values = _kv(64)
    storage = _storage(f"kivi:bits={bits},group=8,residual=0")
    storage.append(keys, values)
    restored_keys, restored_values = storage.materialize()
    key_bound = error_bound(storage.keys.scale, storage.keys.zero, bits).repeat_interleave(8, dim=2)
    value_bound = error_bound(storage.values.scale, storage.values.zero, bits)[..., torch.arange(20) // 8]
    assert bool(((restored_keys - keys).abs() <= key_bound).all())
    assert bool(((restored_values - values).abs() <= value_bound).all())
    # per-channel keys: the step follows each channel's own range, so small channels keep small errors
    assert float((restored_keys - keys)[..., 0].abs().max()) < float((restored_keys - keys)[..., -1].abs().max())


def test_decoding_flushes_one_group_at_a_time(monkeypatch):
    keys, values = _kv(90)
    storage = _storage("kivi:bits=2,group=8,residual=16")
    storage.append(keys[:, :, :40], values[:, :, :40])
    assert (storage.quantized_length, storage.residual_length) == (24, 16)
    flushed = []
    original = kivi_module.quantize_per_channel
    monkeypatch.setattr(kivi_module, "quantize_per_channel",
                        lambda x, bits, group, dtype: flushed.append(x.shape[2]) or original(x, bits, group, dtype))
    old_codes = storage.keys.codes.clone()
    for t in range(40, 90):
        storage.append(keys[:, :, t:t + 1], values[:, :, t:t + 1])
        assert 16 <= storage.residual_length < 16 + 8
    assert flushed == [8] * 6  # O(new tokens): only the group that filled is quantized
    assert torch.equal(storage.keys.codes[:, :, :24], old_codes)
    assert len(storage) == 90


def test_eviction_inside_groups_keeps_codes_and_frees_empty_groups():
    keys, values = _kv(64, heads=3)
    storage = _storage("kivi:bits=2,group=8,residual=8")
    storage.append(keys, values)
    before_keys, before_values = storage.materialize()
    assert storage.keys.scale.shape[2] == 7
    # heads keep different tokens; nobody keeps group 1 (tokens 8..15)
    rows = [[0, 2, 3, 20, 30, 40, 57, 60, 63], [1, 4, 5, 6, 7, 33, 50, 61, 62], [0, 1, 2, 3, 17, 18, 19, 58, 63]]
    index = torch.tensor(rows).unsqueeze(0)
    storage.keep(index)
    after_keys, after_values = storage.materialize()
    expand = index.unsqueeze(-1).expand(-1, -1, -1, 20)
    assert torch.equal(after_keys, before_keys.gather(2, expand))
    assert torch.equal(after_values, before_values.gather(2, expand))
    assert storage.keys.scale.shape[2] < 7 and storage.group_sizes is not None
    assert storage.nbytes().metadata >= storage.group_sizes.numel() * 2
    storage.append(keys[:, :, :12], values[:, :, :12])  # decoding continues after eviction
    assert len(storage) == 21 and storage.materialize()[0].shape[2] == 21


def test_bytes_match_a_hand_count_with_a_partial_group_and_a_residual():
    keys, values = _kv(27)
    storage = _storage("kivi:bits=2,group=8,residual=4")
    storage.append(keys, values)
    # 27 tokens: 2 whole groups quantized (16 tokens), 11 left in full precision (a partial group plus the residual)
    assert (storage.quantized_length, storage.residual_length) == (16, 11)
    heads, dim = 2, 20
    codes = 2 * heads * 16 * (dim * 2 // 8)  # K and V, 5 bytes per token row at 2 bits
    key_meta = heads * 2 * dim * 2 * 2  # 2 token groups x 20 channels, scale + zero, fp16
    value_meta = heads * 16 * 3 * 2 * 2  # 16 tokens x 3 channel groups (8 + 8 + 4), scale + zero, fp16
    residual = 2 * heads * 11 * dim * 4  # fp32 model dtype
    held = storage.nbytes()
    assert (held.codes, held.metadata, held.full_precision) == (codes, key_meta + value_meta, residual)
    assert held.total == 320 + 704 + 3520


def test_bits_per_element_matches_the_storage_without_residual():
    method = parse_spec("kivi:bits=2").quantization
    assert method.bits_per_element(64) == pytest.approx(3.0)  # 2 + (32/32 + 2*32/64) / 2
    storage = method.new_storage(0)
    storage.append(*_kv(64 * 32 + 128, heads=1, dim=64))
    held = storage.nbytes()
    assert (held.codes + held.metadata) * 8 / (2 * 64 * 64 * 32) == pytest.approx(3.0)


class _Rerotating(EvictionMethod):
    name = "fake_rerotate"

    @property
    def rerotate(self) -> bool:
        return True


@pytest.mark.parametrize("quant", ["kivi", "per_token", "bnb"])
def test_rerotating_eviction_is_refused_in_one_line(quant):
    stack = MethodStack(eviction=_Rerotating(), quantization=parse_spec(quant).quantization)
    with pytest.raises(SpecError, match="re-rotates cached keys") as caught:
        stack.quantization.check_stack(stack)
    assert "\n" not in str(caught.value)


PROMPTS = [
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams of dried "
    "yeast and three hundred and fifty millilitres of warm water. Knead the dough for ten minutes until it is smooth, "
    "then leave it to rise in a warm place for an hour. Shape it, let it rise again, and bake it for thirty minutes. "
    "The most common mistake is",
    "Photosynthesis is the process by which green plants use sunlight to turn carbon dioxide and water into sugar and "
    "oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain the "
    "green pigment chlorophyll. The light reactions capture energy and split water, while the Calvin cycle uses that "
    "energy to build sugars. Without photosynthesis,",
]
# residual=32 so that most of these ~100-token prompts is actually stored quantized
SPECS = ["kivi:bits=4,residual=32", "kivi:bits=2,residual=32", "per_token:bits=2,residual=32"]


def test_real_model_agreement_and_key_error(real_model, story_ids):
    from kvviz.comparison.diagnostics import key_channel_stats, prefill_kv, reconstruction_error
    from kvviz.comparison.session import PromptSession, compare

    prompts = [real_model.tokenizer(text)["input_ids"] for text in PROMPTS] + [story_ids[:100]]
    agreement = {spec: [] for spec in SPECS}
    key_error = {spec: [] for spec in SPECS}
    for ids in prompts:
        comparison = compare(real_model, ids, SPECS, max_new_tokens=12)
        for spec in SPECS:
            result = comparison.by_method(parse_spec(spec).label)
            assert result.error is None and result.kv_breakdown.codes > 0
            agreement[spec].append(result.agreement_with_full)
        kv = prefill_kv(PromptSession(real_model, ids))
        for spec in SPECS:
            errors = reconstruction_error(kv, spec).key
            key_error[spec].append(sum(errors) / len(errors))
        assert max(key_channel_stats(kv).outlier_ratio) > 4  # the outlier key channels KIVI exploits
    # measured (greedy, fp32 CPU): agreement kivi4 .92/1/1, kivi2 .83/1/.75, per_token2 .83/.83/.75;
    # mean key error kivi4 .025-.033, kivi2 .13-.17, per_token2 .31-.40
    kivi4, kivi2, naive2 = SPECS
    assert min(agreement[kivi4]) >= 0.75 and sum(agreement[kivi4]) / 3 >= 0.9
    assert sum(agreement[kivi2]) / 3 >= 0.6
    assert sum(agreement[naive2]) < sum(agreement[kivi2])
    assert all(n > 1.3 * k for n, k in zip(key_error[naive2], key_error[kivi2], strict=True))


def test_comparison_reports_quantization_error_from_its_own_prefill(tiny_model):
    """Compare diagnoses its quantizers on the prefill it already ran: the same numbers as a separate prefill."""
    from kvviz.comparison.diagnostics import key_channel_stats, prefill_kv, reconstruction_error
    from kvviz.comparison.session import PromptSession, compare

    ids = list(range(5, 85))
    comparison = compare(tiny_model, ids, ["full", "window:window=16", "kivi:residual=0",
                                           "window:window=16+per_token:bits=4,residual=0"], 3)
    report = comparison.quantization
    assert set(report.errors) == {"kivi:residual=0", "window:window=16+per_token:bits=4,residual=0"}
    kv = prefill_kv(PromptSession(tiny_model, ids))
    alone = reconstruction_error(kv, "kivi:residual=0")
    assert report.errors["kivi:residual=0"].key == pytest.approx(alone.key)
    assert report.errors["kivi:residual=0"].value == pytest.approx(alone.value)
    assert torch.equal(report.key_channels.absmax, key_channel_stats(kv).absmax)
    assert compare(tiny_model, ids, ["full", "window:window=16"], 2).quantization is None


def test_stacks_quantizing_the_same_way_share_one_diagnosis(tiny_model, monkeypatch):
    """kivi:bits=4 alone and after SnapKV store the prompt the same way: the report quantizes it once for both."""
    from kvviz.comparison import diagnostics
    from kvviz.comparison.session import compare

    diagnosed = []
    original = diagnostics.reconstruction_error
    monkeypatch.setattr(diagnostics, "reconstruction_error",
                        lambda kv, stack: diagnosed.append(stack.label) or original(kv, stack))
    report = compare(tiny_model, list(range(5, 85)), ["kivi:bits=4", "snapkv:budget=48+kivi:bits=4"], 2).quantization
    assert diagnosed == ["kivi:bits=4"]
    assert report.errors["snapkv:budget=48+kivi:bits=4"] == report.errors["kivi:bits=4"]


def test_decoding_writes_each_token_in_place_without_copying_the_cache():
    keys, values = _kv(70)
    storage = _storage("kivi:bits=4,group=8,residual=4")
    storage.append(keys[:, :, :60], values[:, :, :60])
    first, _ = storage.materialize()
    for step in range(60, 70):  # flushes a group on the way: it overwrites only that group
        storage.append(keys[:, :, step:step + 1], values[:, :, step:step + 1])
        read, _ = storage.materialize()
        assert read.data_ptr() == first.data_ptr() and read.shape[2] == step + 1
    assert torch.equal(read[:, :, storage.quantized_length:], keys[:, :, storage.quantized_length:])
