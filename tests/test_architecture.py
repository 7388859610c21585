"""The architecture axis: merged KV heads and a low-rank latent, alone and stacked with eviction and quantization."""

import pytest
import torch

from kvviz.cache.architecture import axis_factors
from kvviz.comparison.session import PromptSession, compare
from kvviz.methods import REGISTRY, Budget, SpecError, parse_spec

EVICTIONS = sorted(name for name, cls in REGISTRY.items() if cls.kind == "eviction")
QUANTIZATIONS = ["kivi:bits=2,group=8,residual=8", "per_token:bits=4,group=8,residual=8", "bnb:type=nf4",
                 "hf_quantized:backend=quanto,nbits=4"]
# the tiny model: 2 KV heads of 16 dims, so merge_heads:kv_heads=1 is MQA and lowrank's largest rank is 32
ARCHITECTURES = ["merge_heads:kv_heads=1", "lowrank:rank=8"]


def _eviction_spec(name: str) -> str:
    """The eviction keeping half the prompt (H2O's two budgets a quarter each), re-rotation off (lowrank refuses it)."""
    cls = REGISTRY[name]
    budgets = [p.name for p in cls.params if p.type is Budget]
    parts = [f"{budget}={0.5 / len(budgets):g}" for budget in budgets]
    parts += [f"{p.name}=0" for p in cls.params if p.name == "rerotate"]
    return name + (":" + ",".join(parts) if parts else "")


@pytest.fixture(scope="module")
def session(tiny_model, story_ids):
    return PromptSession(tiny_model, story_ids[:96])


def _stored_bytes(session: PromptSession, spec: str) -> int:
    return session.fork(parse_spec(spec)).nbytes().total


@pytest.mark.parametrize("spec", ["merge_heads:kv_heads=2", "lowrank:rank=32"])
def test_full_heads_and_full_rank_reproduce_full_token_for_token(session, spec):
    full, _ = session.run("full", max_new_tokens=12)
    result, _ = session.run(spec, max_new_tokens=12)
    assert result.token_ids == full.token_ids
    assert result.kv_bytes_per_step == full.kv_bytes_per_step


def test_merge_heads_holds_its_groups_share_of_full_at_every_step(session):
    full, _ = session.run("full", max_new_tokens=6)
    merged, _ = session.run("merge_heads:kv_heads=1", max_new_tokens=6)
    assert merged.kv_bytes_per_step == [b // 2 for b in full.kv_bytes_per_step]
    assert merged.kv_bytes * 2 == merged.kv_bytes_full


def test_lowrank_holds_rank_over_heads_times_dim_and_reports_projections_as_weights(session):
    full, _ = session.run("full", max_new_tokens=6)
    latent, _ = session.run("lowrank:rank=8", max_new_tokens=6)
    assert latent.kv_bytes_per_step == [b * 8 // 32 for b in full.kv_bytes_per_step]
    cache = session.fork(parse_spec("lowrank:rank=8,v_rank=4"))
    assert cache.nbytes().total * 64 == _stored_bytes(session, "full") * 12  # (8 + 4) of 2 * 32 numbers per token
    assert cache.layers[0].storage.weight_bytes() == 32 * (8 + 4) * 4  # projections, fp32, not in nbytes


def test_merged_heads_are_the_mean_of_their_group(session):
    dense = session.fork(parse_spec("full")).layers[0].storage.materialize()[0]
    merged = session.fork(parse_spec("merge_heads:kv_heads=1")).layers[0].storage
    keys, _ = merged.materialize()
    assert keys.shape == dense.shape  # attention reads the model's KV head count
    torch.testing.assert_close(keys[:, 0], dense.mean(1))
    torch.testing.assert_close(keys[:, 1], dense.mean(1))


def test_lowrank_reconstruction_error_shrinks_with_rank(session):
    dense = session.fork(parse_spec("full")).layers[1].storage.materialize()[0]
    errors = [(session.fork(parse_spec(f"lowrank:rank={r}")).layers[1].storage.materialize()[0] - dense).norm()
              for r in (4, 16, 32)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3 * dense.norm()


CASES = [(a, _eviction_spec(e)) for a in ARCHITECTURES for e in EVICTIONS]


@pytest.mark.parametrize("architecture, eviction", CASES)
def test_architecture_stacks_with_every_eviction(session, architecture, eviction):
    method = REGISTRY[eviction.partition(":")[0]]
    if not method.stacks_with_architecture:  # declared, and refused with the reason
        with pytest.raises(SpecError, match="does not stack with an architecture method"):
            parse_spec(f"{architecture}+{eviction}")
        return
    result, _ = session.run(f"{architecture}+{eviction}", max_new_tokens=3)
    assert result.error is None and len(result.token_ids) == 3
    heads = parse_spec(architecture).architecture.cache_heads(2)
    assert result.ledger.kv_heads == heads
    cache = session.fork(parse_spec(f"{architecture}+{eviction}"))
    factors = axis_factors(cache, 2, 16, len(session.prompt_ids), 4)
    assert cache.layers[0].positions.shape[1] == heads
    assert factors.measured_bytes == pytest.approx(factors.predicted_bytes)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("quant", QUANTIZATIONS)
def test_architecture_stacks_with_every_quantization(session, architecture, quant):
    if quant.startswith("hf_quantized"):
        pytest.importorskip("optimum.quanto")
        spec = f"{architecture}+{quant}"  # transformers' quantized layer cannot drop tokens
    else:
        spec = f"{architecture}+random:budget=0.5+{quant}"
    result, _ = session.run(spec, max_new_tokens=3)
    assert result.error is None and len(result.token_ids) == 3
    alone = _stored_bytes(session, spec.split("+", 1)[1])
    assert result.kv_bytes < alone  # the quantizer stores the architecture's fewer numbers


@pytest.mark.parametrize("architecture", ["merge_heads:kv_heads=1", "lowrank:rank=16"])
def test_product_of_the_three_savings_matches_measured_bytes(session, architecture):
    full = _stored_bytes(session, "full")
    eviction, quant = "window:window=24", "bnb:type=int8"
    savings = [_stored_bytes(session, spec) / full for spec in (architecture, eviction, quant)]
    stacked = _stored_bytes(session, f"{architecture}+{eviction}+{quant}")
    assert stacked == pytest.approx(full * savings[0] * savings[1] * savings[2], rel=1e-9)
    factors = axis_factors(session.fork(parse_spec(f"{architecture}+{eviction}+{quant}")), 2, 16, 96, 4)
    assert factors.predicted_bytes == pytest.approx(stacked)
    assert (factors.architecture, factors.eviction) == pytest.approx((savings[0], savings[1]))


def test_rerotating_streaming_llm_writes_one_key_per_merged_group(session):
    result, _ = session.run("merge_heads:kv_heads=1+streaming_llm:sinks=4,window=20", max_new_tokens=4)
    assert result.error is None and len(result.token_ids) == 4


def test_spec_takes_one_method_per_axis_in_any_order():
    label = parse_spec("kivi:bits=4+window:window=64+lowrank:rank=48").label
    assert label == "lowrank:rank=48+window:window=64+kivi:bits=4"
    with pytest.raises(SpecError, match="two architecture methods.*at most one per axis"):
        parse_spec("merge_heads:kv_heads=1+lowrank:rank=8")
    with pytest.raises(SpecError, match="re-rotates.*lowrank"):
        parse_spec("lowrank:rank=8+streaming_llm:rerotate=1")
    with pytest.raises(SpecError, match="v_rank"):
        parse_spec("lowrank:rank=8,v_rank=4+kivi")


@pytest.mark.parametrize("spec, message", [
    ("lowrank:rank=33", "above this model's kv_heads \\* head_dim = 32"),
    ("lowrank:rank=8,v_rank=40", "v_rank=40 is above"),
    ("merge_heads:kv_heads=3", "does not divide this model's 2 KV heads; choose 1\\|2"),
])
def test_spec_errors_known_only_with_the_model(session, spec, message):
    parse_spec(spec)  # well-formed on its own
    with pytest.raises(SpecError, match=message):
        session.fork(parse_spec(spec))


def test_compare_reports_a_misfit_architecture_next_to_the_others(tiny_model, story_ids):
    comparison = compare(tiny_model, story_ids[:40], ["full", "merge_heads:kv_heads=3", "merge_heads:kv_heads=1"],
                         max_new_tokens=2)
    assert "does not divide" in comparison.by_method("merge_heads:kv_heads=3").error
    assert comparison.by_method("merge_heads").error is None


def test_default_model_mqa_is_a_third_and_lowrank_is_rank_over_192(real_model, story_ids):
    session = PromptSession(real_model, story_ids[:24])
    full = _stored_bytes(session, "full")
    assert _stored_bytes(session, "merge_heads:kv_heads=1") * 3 == full
    assert _stored_bytes(session, "lowrank:rank=48") * 192 == full * 48


@pytest.fixture(scope="module")
def tiny_deepseek():
    """A 2-layer random DeepSeek-V2 (MLA: latent 16 + RoPE 8; transformers caches per-head K 24 and V 16)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from kvviz.cache.attention import install_attention
    from kvviz.runtime.models import LoadedModel

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=256,
    )
    model = DeepseekV2ForCausalLM(config).eval()
    install_attention(model)
    return LoadedModel(name="tiny-deepseek-v2", model=model, tokenizer=None, device="cpu", dtype=torch.float32)


def test_deepseek_card_reports_the_latent_and_what_transformers_stores(tiny_deepseek):
    from kvviz.planning.memory import model_card

    card = model_card(tiny_deepseek)
    assert card.attention == "MLA" and card.mla_latent_dim == 16 + 8
    assert card.kv_bytes(10) == 2 * 24 * 10 * 4  # the latent an MLA kernel caches
    assert card.stored_kv_bytes(10) == 2 * 4 * (24 + 16) * 10 * 4  # transformers: decompressed per-head K and V
    assert "transformers' cache stores 12,800 B" in card.formula_text(10)


def test_deepseek_replays_and_measures_what_transformers_stores(tiny_deepseek):
    comparison = compare(tiny_deepseek, list(range(5, 45)), ["full", "window:window=16", "merge_heads:kv_heads=2",
                                                             "lowrank:rank=32"], max_new_tokens=4)
    full = comparison.by_method("full")
    assert full.error is None and len(full.token_ids) == 4
    assert full.kv_bytes == full.kv_bytes_full  # 43 tokens fed: the card's stored bytes are the measured ones
    assert comparison.by_method("window:window=16").kv_bytes == full.kv_bytes * 16 // 43
    merged = comparison.by_method("merge_heads:kv_heads=2")
    assert merged.kv_bytes * 2 == full.kv_bytes and merged.axis_factors.predicted_bytes == merged.kv_bytes
    # keys rotate 8 of their 24 channels (decoupled RoPE): the latent cannot undo RoPE on the rest
    assert "decoupled RoPE" in comparison.by_method("lowrank:rank=32").error


# every quantizer at settings that leave no full-precision residual: 40 prompt tokens + 8 fed = whole groups of 8
MLA_QUANTIZATIONS = {
    "kivi": "kivi:bits=2,group=8,residual=0",
    "per_token": "per_token:bits=4,group=8,residual=0",
    "bnb": "bnb:type=nf4",
    "fp8": "fp8:scale=token",
    "hf_quantized": "hf_quantized:backend=quanto,nbits=4,residual=1",
}
MLA_STACKS = ["window:window=16+kivi:bits=2,group=8,residual=0", "window:window=16+bnb:type=nf4"]


def test_every_quantizer_replays_an_mla_model_and_holds_its_formula_bytes(tiny_deepseek):
    """Keys 24 wide, values 16: each quantizer stores each at its own width and the bytes follow the formula."""
    assert set(MLA_QUANTIZATIONS) == {name for name, cls in REGISTRY.items() if cls.kind == "quantization"}
    specs = ["full", *MLA_QUANTIZATIONS.values(), *MLA_STACKS]
    comparison = compare(tiny_deepseek, list(range(5, 45)), specs, max_new_tokens=9)
    full = comparison.results[0]
    assert full.kv_bytes == 2 * 4 * (24 + 16) * 48 * 4  # 2 layers, 4 heads, K 24 + V 16, 48 tokens fed, fp32
    for spec, result in zip(specs[1:], comparison.results[1:], strict=True):
        assert result.error is None, f"{spec}: {result.error}"
        assert len(result.token_ids) == 9 and result.kv_breakdown.full_precision == 0
        method = parse_spec(spec).quantization
        kept = 16 / 48 if spec.startswith("window") else 1.0
        if method.name == "hf_quantized":  # quanto keeps each group's scale and zero in the model's dtype (fp32 here)
            bits = 4 + 2 * 32 / 64
        else:
            bits = method.bits_per_element(24, 16)
            assert result.axis_factors.predicted_bytes == pytest.approx(result.kv_bytes)
        assert result.kv_bytes == pytest.approx(full.kv_bytes * kept * bits / 32)
    # bnb pads each key and each value to its own 64-element block: the widths are not averaged away
    assert parse_spec("bnb:type=nf4").quantization.bits_per_element(24, 16) == (2 * (64 * 4 + 32)) / 40
    assert set(comparison.quantization.errors) == {result.method for result in comparison.results[1:]}


def test_every_rank_of_one_prompt_reads_one_decomposition():
    from kvviz.methods import lowrank

    samples = torch.randn(40, 12, generator=torch.Generator().manual_seed(3))
    lowrank._BASES.clear()
    wide, narrow = lowrank.principal_directions(samples, 6), lowrank.principal_directions(samples, 2)
    assert len(lowrank._BASES) == 1 and torch.equal(wide[:, :2], narrow)
    fresh = torch.linalg.eigh(samples.double().T @ samples.double())[1].flip(-1)[:, :6]
    assert torch.equal(wide, fresh)
    lowrank.principal_directions(samples * 2, 2)  # another covariance: its own decomposition
    assert len(lowrank._BASES) == 2
