"""Fixtures for the method tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def long_story_ids(story_ids) -> list[int]:
    """A ~500-token prompt (the story told a little over twice): long enough for 64-token windows and pyramids."""
    return (story_ids * 3)[:520]
