"""The capacity planner: catalog facts, the KV formula per attention kind, and eviction x quantization composition."""

import pytest

from kvviz.planning.planner import GB, Plan, attention_variants, cached_tokens, effective_bits, load_catalog, make_plan


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


def test_published_contexts_reach_128k_and_the_sliders_offer_them(catalog):
    for name in ("Llama-3.1-70B", "Llama-3.1-8B", "DeepSeek-V2", "Qwen2.5-7B"):
        assert catalog.context(name) == 131072, name
        assert catalog.contexts(name)[-1] == 131072
    assert catalog.context("Mistral-7B-v0.3") == 32768
    assert "YaRN" in catalog.models["Qwen2.5-7B"]["context_note"]
    # at 128K one Llama-3.1-70B sequence pins tens of GB in 16 bits (80 layers x 8 KV heads x 128 x 2 x 2 B)
    result = make_plan(catalog.card("Llama-3.1-70B"), catalog.models["Llama-3.1-70B"]["parameters"],
                       Plan(context=131072))
    assert 40 < result.kv_bytes_per_sequence / GB < 45


def test_llama_13b_worked_numbers(catalog):
    card = catalog.card("LLaMA-13B")
    assert (card.layers, card.q_heads, card.kv_heads, card.head_dim, card.attention) == (40, 40, 40, 128, "MHA")
    assert card.kv_bytes_per_token == 819_200  # about 1 MB per token
    assert 2048 in catalog.contexts("LLaMA-13B")
    two_k = make_plan(card, catalog.models["LLaMA-13B"]["parameters"], Plan(context=2048))
    assert round(two_k.kv_bytes_per_sequence / GB, 2) == 1.68  # about 1.7 GB for a 2K-token sequence in fp16


def test_a_measured_configuration_s_layouts_project_onto_a_shape_as_sequences_per_gpu(catalog):
    from kvviz.planning.planner import project_layouts

    card = catalog.card("Llama-3-8B")
    parameters = catalog.models["Llama-3-8B"]["parameters"]
    plan = Plan(context=8192, gpu_gb=80, budget=0.1, kv_bits=2)  # the measured configuration replaces these
    full = make_plan(card, parameters, Plan(context=8192, gpu_gb=80))
    held = {"counted": 250, "paged_shared": 1000, "paged_per_head": 260}
    counted, paged, per_head = project_layouts(card, parameters, plan, held, full_bytes=1000)
    assert paged.share_of_full == 1.0 and paged.kv_bytes_per_sequence == full.kv_bytes_per_sequence
    assert paged.max_sequences == full.max_sequences
    assert counted.share_of_full == 0.25 and counted.max_sequences >= 4 * full.max_sequences
    assert counted.max_sequences > per_head.max_sequences > paged.max_sequences


def test_gemma3_family_caps_its_local_layers_at_the_window_and_eviction_buys_only_on_global_ones(catalog):
    sizes = {"Gemma-3-270M": (18, 3, 512), "Gemma-3-1B": (26, 4, 512), "Gemma-3-4B": (34, 5, 1024),
             "Gemma-3-12B": (48, 8, 1024), "Gemma-3-27B": (62, 10, 1024)}
    for name, (layers, global_layers, window) in sizes.items():
        types = catalog.card(name).layer_types
        assert (len(types), types.global_layers, types.window) == (layers, global_layers, window)
        assert types.windows[5] is None and types.windows[0] == window  # five local layers, then a global one
    card = catalog.card("Gemma-3-270M")  # MQA: 1 KV head of 256 dims, 2 * 256 * 2 B = 1 KiB per layer and token
    assert card.kv_bytes(32768) == 1024 * (3 * 32768 + 15 * 511)
    assert card.kv_bytes(300) == card.kv_bytes_per_token * 300  # inside the window every layer holds every token
    assert card.global_kv_bytes_per_token == 3 * 1024
    full = make_plan(card, 2.68e8, Plan(context=32768))
    evicted = make_plan(card, 2.68e8, Plan(context=32768, budget=1024))
    assert full.kv_bytes_per_sequence == full.kv_bytes_full_per_sequence == card.kv_bytes(32768, bytes_per_element=2)
    assert evicted.kv_bytes_per_sequence == 1024 * (3 * 1024 + 15 * 511)  # the local layers keep their windows
    assert "15 local layers" in card.formula_text(32768) and "min(32768, 512 - 1)" in card.formula_text(32768)
    mistral = catalog.card("Mistral-7B-v0.1")
    assert mistral.layer_types.local_layers == 32 and mistral.kv_bytes(8192) == mistral.kv_bytes(4095)
    assert "past the 512-token window (3 global layers)" in attention_variants(card)
