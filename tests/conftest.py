"""Shared fixtures: a tiny random-weight GQA Llama (fast) and the real embedded models (each loaded once a session)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Stored results (kvviz.runs) go to a folder of this test session: a run never reads another session's results.
os.environ["KVVIZ_RESULTS"] = tempfile.mkdtemp(prefix="kvviz-results-")


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct from the embedded GGUF (converted once)."""
    from kvviz.runtime.models import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M, the second embedded model (converted once), loaded once per session: 18 layers of which 15 slide
    over a 512-token window, one KV head, a 262K vocabulary. Tests on it are few: each forward costs ~3x SmolLM2's."""
    from kvviz.runtime.models import load_model
    from kvviz.runtime.settings import GEMMA_MODEL

    return load_model(GEMMA_MODEL, device="cpu")


@pytest.fixture(scope="session")
def tiny_model(real_model):
    """A 2-layer random Llama with GQA (4 query heads over 2 KV heads) sharing the real tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvviz.cache.attention import install_attention
    from kvviz.runtime.models import LoadedModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=real_model.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    install_attention(model)
    return LoadedModel(name="tiny-llama", model=model, tokenizer=real_model.tokenizer, device="cpu",
                       dtype=torch.float32)


@pytest.fixture(scope="session")
def story_ids(real_model) -> list[int]:
    """A ~200-token plain-text prompt."""
    text = (
        "The lighthouse keeper of Saint Brennan's Rock kept a logbook for forty years. Every evening he wrote the "
        "wind, the swell, the ships that passed, and one sentence about the birds. In the winter of the great "
        "storm he wrote nothing for nine days, and when the supply boat finally reached the rock the crew found "
        "him asleep beside the lamp, which had never once gone dark. Asked how he had kept it burning, he said "
        "that the secret was a spare wick, a dry box of matches, and a stubborn refusal to sleep before dawn. "
        "The logbook is now kept in the harbour museum, open at the page for the first calm morning after the "
        "storm, where he wrote: the gulls came back today. "
    )
    return real_model.tokenizer(text * 2)["input_ids"]


def _need_a_browser() -> str:
    """Debian's chromium, or skip the test: browser tests run where ``make browser`` installed it."""
    from kvviz.bench.browser import chromium_path

    chromium = chromium_path()
    if chromium is None:
        pytest.skip("chromium is not installed (make browser, or apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return chromium


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """A plain ``streamlit run app.py`` (as ``make run`` serves it) on a free port, shared by the browser tests until
    the session ends (one start instead of one per module)."""
    from kvviz.bench.browser import served_app

    _need_a_browser()
    with served_app(tmp_path_factory.mktemp("streamlit") / "server.log", startup=60) as app:
        yield app


@pytest.fixture(scope="session")
def server(served) -> str:
    """The served app's address."""
    return served.url


@pytest.fixture
def page():
    """A new page (1400 x 1000) in a headless chromium of its own, closed when the test ends."""
    chromium = _need_a_browser()
    from playwright.sync_api import sync_playwright

    from kvviz.bench.browser import CHROMIUM_ARGS

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()
