"""kvpress presses run by kvpress itself, mapped back to token positions (kvviz.methods.kvpress.native)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from kvviz.comparison.session import PromptSession, compare
from kvviz.comparison.startup import apply_settings
from kvviz.methods import SpecError, parse_spec
from kvviz.methods.kvpress.catalog import configure_presses, load_press_class, press_catalog
from kvviz.methods.kvpress.coverage import HUB, NOT_MAPPABLE, RUNS, coverage
from kvviz.methods.kvpress.native import KVPressNative
from kvviz.methods.kvpress.report import NotMappable
from kvviz.methods.kvpress.rowmatch import match_rows

logging.getLogger("kvpress").setLevel(logging.ERROR)

# presses that read the model's own files (its tokenizer): the embedded model has them, the tiny one does not
NEEDS_REAL_MODEL = {"kvzip", "kvgrad"}
# settings a press needs beyond its defaults
EXTRA = {"dms": ",threshold=0.01"}
# presses that, by design, keep every token on a random-weight model (channels, or no lazy layer found)
KEEPS_ALL_TOKENS = {"think", "simlayerkv"}


@pytest.fixture
def server_settings(monkeypatch):
    """Set KVVIZ_* variables, then hand the settings to the press catalog as the CLI's and the app's start-up do; the
    catalog offers no own press again afterwards."""

    def start(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        apply_settings()

    yield start
    configure_presses((), True)


@pytest.fixture(scope="module")
def tiny_ids() -> list[int]:
    return torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def real_ids(real_model) -> list[int]:
    """About 320 tokens of generated filler sentences (kvviz's needle haystack)."""
    from kvviz.studies.needle import build_needle_prompt

    return build_needle_prompt(real_model.tokenizer, 320, 0.5, chat=False).ids


def kept_sets(cache) -> torch.Tensor:
    """[layers, kv_heads, N] True where the prefill's compression kept the token."""
    return cache.ledger.kept_mask(0)[..., : cache.prompt_length]


@pytest.mark.parametrize("row", coverage(), ids=lambda row: row.press)
def test_every_kvpress_press_runs_as_the_coverage_table_says(row, tiny_model, real_model, tiny_ids, real_ids):
    spec = f"kvpress_native:press={row.press}{EXTRA.get(row.press, '')}"
    if row.status == HUB:
        with pytest.raises(SpecError, match="not available offline"):
            parse_spec(spec)
        pytest.skip(f"{row.press} {row.why}")
    loaded, ids = (real_model, real_ids[:64]) if row.press in NEEDS_REAL_MODEL else (tiny_model, tiny_ids)
    if row.status == NOT_MAPPABLE:
        with pytest.raises(NotMappable) as refused:
            PromptSession(loaded, ids).run(spec, 2)
        assert row.why.split(";")[0][:40] in str(refused.value)
        return
    assert row.status == RUNS
    stack = parse_spec(spec)
    result, _ = PromptSession(loaded, ids).run(stack, 2)
    assert result.error is None and len(result.token_ids) == 2
    kept = result.ledger.kept_mask(0)[..., : len(ids)].sum(-1)
    report = stack.eviction.report
    assert report.nearest_rows == 0 or report.rerotated  # every row found bit-identical, unless keys were re-rotated
    if row.press in KEEPS_ALL_TOKENS:
        assert bool((kept == len(ids)).all())
    else:
        assert int(kept.min()) < len(ids)  # the press did drop tokens, and the ledger shows it
    if report.masked:
        assert result.kv_bytes < result.kv_bytes_full


def test_native_and_kvviz_scorers_keep_the_same_tokens_on_the_real_model(real_model, real_ids):
    """kvviz's own snapkv / streaming_llm and its kvpress adapter against the presses run natively: >= 99% of each
    layer x KV head's kept tokens agree."""
    length = len(real_ids)
    kept = int(length * 0.5)
    pairs = {
        "snapkv": f"snapkv:budget={kept},window=64,kernel=5,pool=avg",
        "streamingllm": f"streaming_llm:sinks=4,window={kept - 4},rerotate=0",
        "knorm": "kvpress:press=knorm,ratio=0.5",
        "tova": "kvpress:press=tova,ratio=0.5",
        "expectedattention": "kvpress:press=expected_attention,ratio=0.5",
        "keydiff": "kvpress:press=keydiff,ratio=0.5",
        "lagkv": "kvpress:press=lagkv,ratio=0.5",
    }
    session = PromptSession(real_model, real_ids)
    worst = {}
    for press, spec in pairs.items():
        native = kept_sets(session.fork(parse_spec(f"kvpress_native:press={press}")))
        own = kept_sets(session.fork(parse_spec(spec)))
        shared = (native & own).sum(-1).float() / own.sum(-1).clamp(min=1)
        assert bool((native.sum(-1) == own.sum(-1)).all()), press
        worst[press] = float(shared.min())
    assert all(agreement >= 0.99 for agreement in worst.values()), worst


def test_rerotated_keys_map_to_the_inner_press_kept_tokens(tiny_model, tiny_ids):
    session = PromptSession(tiny_model, tiny_ids)
    rerotated = parse_spec("kvpress_native:press=keyrerotation,inner=knorm")
    plain = kept_sets(session.fork(parse_spec("kvpress_native:press=knorm")))
    assert torch.equal(kept_sets(session.fork(rerotated)), plain)
    assert rerotated.eviction.report.rerotated and rerotated.eviction.report.max_distance < 1e-3


def test_channel_pruning_is_reported_as_channels_kept_per_head(tiny_model, tiny_ids):
    stack = parse_spec("kvpress_native:press=think,key_channel_compression_ratio=0.25")
    PromptSession(tiny_model, tiny_ids).fork(stack)
    head_dim = tiny_model.config.head_dim
    assert stack.eviction.report.channels_kept == [[head_dim - head_dim // 4] * 2] * 2


def test_merging_reports_which_evicted_token_went_into_which_survivor(tiny_model, tiny_ids):
    stack = parse_spec("kvpress_native:press=merging,inner=knorm")
    cache = PromptSession(tiny_model, tiny_ids).fork(stack)
    merged = stack.eviction.report.merged_into
    assert merged
    for layer, targets in merged.items():
        kept = kept_sets(cache)[layer]
        for head in range(targets.shape[0]):
            into = targets[head]
            assert not bool((into[kept[head]] >= 0).any())  # survivors are not merged away
            assert bool(kept[head][into[into >= 0]].all())  # merged tokens go into survivors


def test_head_wise_press_decodes_as_kvpress_masking_does(tiny_model, tiny_ids):
    """AdaKV keeps different counts per head; kvviz holds the extra rows blocked. The next token's logits equal
    those of kvpress's own cache with its in-place masking."""
    import kvpress
    from transformers import DynamicCache

    stack = parse_spec("kvpress_native:press=adakv,inner=knorm")
    _, trace = PromptSession(tiny_model, tiny_ids).run(stack, 2, keep_logprobs=True)
    assert stack.eviction.report.masked and stack.eviction.report.blocked_entries > 0
    model = tiny_model.model
    press = kvpress.AdaKVPress(kvpress.KnormPress(compression_ratio=0.5))
    cache = DynamicCache(config=model.config)
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"  # kvpress patched SDPA to mask in place
    try:
        with torch.inference_mode():
            with press(model):
                model(input_ids=torch.tensor([tiny_ids]), past_key_values=cache, use_cache=True)
            first = int(trace.step_logprobs[0].argmax())
            logits = model(input_ids=torch.tensor([[first]]), past_key_values=cache, use_cache=True).logits[0, -1]
    finally:
        model.config._attn_implementation = implementation
        for layer in model.model.layers:
            layer.self_attn.__dict__.pop("masked_key_indices", None)
            layer.self_attn._modules.pop("rotary_emb", None)
    assert torch.allclose(torch.log_softmax(logits.float(), -1), trace.step_logprobs[1], atol=1e-4)


def test_native_press_leaves_the_shared_model_as_it_was(tiny_model, tiny_ids):
    before = set(tiny_model.model.state_dict())
    PromptSession(tiny_model, tiny_ids).fork(parse_spec("kvpress_native:press=adakv"))
    attention = tiny_model.model.model.layers[0].self_attn
    assert set(tiny_model.model.state_dict()) == before
    assert "masked_key_indices" not in attention.__dict__ and "rotary_emb" not in attention._modules


def test_compare_shows_a_native_press_with_agreement_and_ledger(tiny_model, tiny_ids):
    comparison = compare(tiny_model, tiny_ids, ["kvpress_native:press=snapkv,compression_ratio=0.75"],
                         max_new_tokens=4)
    native = comparison.results[1]
    assert native.error is None and native.agreement_with_full is not None
    assert native.ledger.kept_mask(0)[..., : len(tiny_ids)].sum(-1).eq(75).all()
    assert native.kv_bytes < native.kv_bytes_full / 3


def test_press_parameters_come_from_its_dataclass_fields():
    method = KVPressNative(press="snapkv", window_size=32)
    params = {p.name: p for p in method.params}
    assert params["window_size"].default == 64 and params["kernel_size"].type is int
    assert params["compression_ratio"].default == 0.5  # kvpress's 0 (no compression) would show nothing
    assert method.spec() == "kvpress_native:window_size=32"
    assert method.build_press(num_layers=2).window_size == 32
    with pytest.raises(SpecError, match="window_size"):
        KVPressNative(press="snapkv", window_size="wide")
    wrapper = {p.name for p in KVPressNative(press="adakv", inner="tova").params}
    assert {"inner", "alpha_safeguard", "compression_ratio"} <= wrapper
    with pytest.raises(SpecError, match="unknown kvpress press 'nope'"):
        parse_spec("kvpress_native:press=nope")


def test_decoding_presses_are_refused_with_the_reason():
    with pytest.raises(NotMappable, match="compresses while decoding"):
        parse_spec("kvpress_native:press=decoding")


def _every_other_press():
    """A user's own press, importable by dotted path: keeps every other token."""
    import kvpress

    @dataclass
    class EveryOtherTokenPress(kvpress.BasePress):
        keep_odd: bool = False

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            start = 1 if self.keep_odd else 0
            return keys[:, :, start::2].contiguous(), values[:, :, start::2].contiguous()

    return EveryOtherTokenPress


OwnPress = _every_other_press()


def test_own_press_from_the_server_settings_appears_and_runs(server_settings, tiny_model, tiny_ids):
    server_settings(KVVIZ_PRESSES=f"{__name__}.OwnPress")
    assert "everyothertoken" in press_catalog()
    stack = parse_spec("kvpress_native:press=everyothertoken,keep_odd=1")
    kept = kept_sets(PromptSession(tiny_model, tiny_ids).fork(stack))
    assert bool(kept[..., 1::2].all()) and not bool(kept[..., 0::2].any())


def test_own_press_is_refused_in_class_mode_unless_allowed(server_settings):
    server_settings(KVVIZ_PRESSES=f"{__name__}.OwnPress", KVVIZ_ALLOWED_MODELS="smollm2-135m-instruct")
    assert "everyothertoken" not in press_catalog()
    with pytest.raises(SpecError, match="unknown kvpress press"):
        parse_spec("kvpress_native:press=everyothertoken")
    server_settings(KVVIZ_ALLOW_PRESSES="1")
    assert "everyothertoken" in press_catalog()


def test_the_catalog_offers_what_the_entry_point_hands_it_not_what_the_environment_says(monkeypatch,
                                                                                        server_settings):
    monkeypatch.setenv("KVVIZ_PRESSES", f"{__name__}.OwnPress")
    assert "everyothertoken" not in press_catalog()
    server_settings()
    assert "everyothertoken" in press_catalog()


def test_unimportable_own_press_is_one_line():
    with pytest.raises(SpecError, match="cannot be imported"):
        load_press_class("no_such_package.Press")


def test_a_broken_press_setting_costs_only_itself_and_the_config_check_names_it(server_settings, capsys):
    """One unimportable entry in KVVIZ_PRESSES: the other presses (kvpress's and the good own one) still run, asking
    for a missing press says what is wrong with the setting, and ``python -m kvviz config`` (the container's start
    check) refuses it."""
    from kvviz.cli import main

    server_settings(KVVIZ_PRESSES=f"no_such_package.Press,{__name__}.OwnPress")
    assert {"everyothertoken", "snapkv"} <= set(press_catalog())
    parse_spec("kvpress_native:press=snapkv")
    with pytest.raises(SpecError, match="KVVIZ_PRESSES: press 'no_such_package.Press' cannot be imported"):
        parse_spec("kvpress_native:press=press")
    assert main(["config"]) == 2
    assert "no_such_package.Press" in capsys.readouterr().err


def test_row_matching_finds_kept_rows_exactly_and_changed_rows_nearest():
    full = torch.randn(1, 2, 50, 8, generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.randperm(50)[:20] for _ in range(2)]).unsqueeze(0)
    compressed = full.gather(2, positions.unsqueeze(-1).expand(-1, -1, -1, 8)).clone()
    compressed[0, 1, 3] += 1e-3  # one row changed a little
    found = match_rows(full, compressed)
    assert torch.equal(found.positions, positions)
    assert int((~found.exact).sum()) == 1 and not bool(found.exact[0, 1, 3])


def test_compare_json_carries_what_channel_pruning_and_merging_did(tiny_model, tiny_ids):
    comparison = compare(tiny_model, tiny_ids, ["kvpress_native:press=think,key_channel_compression_ratio=0.25",
                                                "kvpress_native:press=merging,inner=knorm", "snapkv:budget=64"],
                         max_new_tokens=2)
    full, think, merging, own = comparison.to_json()["results"]
    assert "kvpress_native" not in full and "kvpress_native" not in own
    head_dim = tiny_model.config.head_dim
    assert think["kvpress_native"]["channels_kept_per_head"] == [[head_dim - head_dim // 4] * 2] * 2
    assert any("Key channels kept per KV head: 12" in line for line in think["kvpress_native"]["summary"])
    report = merging["kvpress_native"]
    merges = [triple for layer in report["merges"].values() for triple in layer]
    assert report["merged_entries"] == len(merges) > 0 and report["merge_survivors"] > 0
    kept = comparison.results[2].ledger.kept_mask(0)[..., : len(tiny_ids)]
    layer = int(next(iter(report["merges"])))
    assert all(bool(kept[layer, head, into]) and not bool(kept[layer, head, token])
               for head, token, into in report["merges"][str(layer)])
    assert any("merged into" in line for line in report["summary"])
    brief = comparison.to_json(with_ledger=False)["results"][2]["kvpress_native"]
    assert "merges" not in brief and brief["merged_entries"] == report["merged_entries"]


def test_a_press_whose_rows_match_no_token_is_an_error_not_a_ledger(server_settings, tiny_model, tiny_ids):
    server_settings(KVVIZ_PRESSES="tests.own_presses.KeyScalingPress")
    comparison = compare(tiny_model, tiny_ids, ["kvpress_native:press=keyscaling"], max_new_tokens=2)
    result = comparison.results[1]
    assert "changed keys in layer 0" in result.error
    assert result.ledger is None and result.native_report is None and result.kv_bytes == 0
    assert "ledger" not in comparison.to_json()["results"][1]
