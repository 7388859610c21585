"""The capacity planner: catalog facts, the KV formula per attention kind, and eviction x quantization composition."""

import pytest

from kvviz.planner import GB, Plan, attention_variants, cached_tokens, effective_bits, load_catalog, make_plan


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_ships_the_models_the_issue_names(catalog):
    for name in ("Llama-2-13B", "Llama-3-8B", "Qwen2.5-7B", "Mistral-7B-v0.3", "DeepSeek-V2"):
        assert name in catalog.models
    assert catalog.gpus["NVIDIA H100 (80 GB)"] == 80


def test_per_token_bytes_match_published_shapes(catalog):
    # Llama-2-13B (MHA): 2 * 40 layers * 40 heads * 128 * 2 B = 800 KiB per token, ~1 MB as often quoted.
    assert catalog.card("Llama-2-13B").kv_bytes_per_token == 2 * 40 * 40 * 128 * 2
    llama3 = catalog.card("Llama-3-8B")
    assert (llama3.attention, llama3.kv_bytes_per_token) == ("GQA", 131072)
    assert catalog.card("Falcon-7B").attention == "MQA"
    deepseek = catalog.card("DeepSeek-V2")
    assert deepseek.attention == "MLA"
    assert deepseek.kv_bytes_per_token == 60 * (512 + 64) * 2


def test_attention_variants_order(catalog):
    variants = attention_variants(catalog.card("Llama-3-8B"))
    assert variants["MHA"] == 4 * variants["GQA (8 KV heads)"] == 32 * variants["MQA"]
    mla = attention_variants(catalog.card("DeepSeek-V2"))
    assert mla["MQA"] < mla["MLA (latent 576)"] < mla["MHA"] / 50  # between MQA and MHA, far nearer MQA


def test_budgets_and_bits():
    assert cached_tokens(8192, None) == 8192
    assert cached_tokens(8192, 1024) == 1024
    assert cached_tokens(8192, 0.25) == 2048
    assert cached_tokens(100, 1024) == 100
    assert effective_bits(16, 32) == 16
    assert effective_bits(2, 32) == 3  # 2 bits + (16-bit scale + 16-bit zero) / 32
    assert effective_bits(4, 0) == 4


def test_plan_composes_eviction_quantization_and_gpu(catalog):
    card = catalog.card("Llama-3-8B")
    params = catalog.models["Llama-3-8B"]["parameters"]
    full = make_plan(card, params, Plan(context=8192, batch=8, gpu_gb=80))
    assert full.kv_bytes_per_sequence == 8192 * 131072
    assert full.weight_bytes == pytest.approx(16.06 * GB, rel=1e-3)
    assert full.max_sequences == int((72 * GB - full.weight_bytes) // full.kv_bytes_per_sequence)
    assert full.fits and full.compression == 1
    # a quarter of the tokens at 2 bits (+1 bit of metadata): 4 * 16 / 3 times smaller
    small = make_plan(card, params, Plan(context=8192, batch=8, budget=0.25, kv_bits=2, group_size=32, gpu_gb=80))
    assert small.compression == pytest.approx(4 * 16 / 3, rel=1e-3)
    assert small.max_sequences > 20 * full.max_sequences
    # a residual of recent tokens stays at 16 bits
    residual = make_plan(card, params, Plan(context=8192, kv_bits=2, group_size=32, residual_tokens=128))
    assert residual.kv_bytes_per_sequence == (8064 * 3 + 128 * 16) * card.kv_elements_per_token // 8


def test_weights_that_do_not_fit(catalog):
    outcome = make_plan(catalog.card("DeepSeek-V2"), catalog.models["DeepSeek-V2"]["parameters"],
                        Plan(context=4096, gpu_gb=80))
    assert outcome.max_sequences == 0 and not outcome.fits
