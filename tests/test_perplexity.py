"""streaming_perplexity: full in chunks equals token by token; policies apply as tokens arrive."""

from __future__ import annotations

import math

import pytest
import torch

from kvviz.methods import SpecError
from kvviz.studies.perplexity import _full_chunked, _streamed, streaming_perplexity


@pytest.fixture(scope="module")
def text_ids(tiny_model) -> list[int]:
    ids = tiny_model.tokenizer("Now is the winter of our discontent made glorious summer by this sun of York. " * 30)
    return ids["input_ids"][:300]


def _steps_result(steps):
    """What a study's steps return, driven here to their end (they ask for nothing but turns)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def test_full_in_chunks_equals_token_by_token(tiny_model, text_ids, monkeypatch):
    monkeypatch.setattr("kvviz.studies.perplexity.CHUNK", 48)  # several chunk boundaries on a short text
    chunked, chunked_bytes = _steps_result(_full_chunked(tiny_model, text_ids[:130], None))
    streamed, streamed_bytes = _steps_result(_streamed(tiny_model, text_ids[:130], "full", lambda f, m: None))
    assert chunked.shape == streamed.shape == (129,)
    torch.testing.assert_close(chunked, streamed, rtol=1e-4, atol=1e-4)
    assert chunked_bytes == streamed_bytes > 0  # both caches end holding the same tokens, uncompressed


def test_result_fields_and_start(tiny_model, text_ids):
    seen = []
    full = streaming_perplexity(tiny_model, text_ids, "full", start=100, progress=lambda f, m: seen.append(f))
    assert (full.method, full.tokens, full.start, full.exact) == ("full", 200, 100, False)
    assert len(full.per_token_nll) == 200 and math.isclose(full.ppl, math.exp(full.nll))
    assert math.isclose(full.nll, sum(full.per_token_nll) / 200, rel_tol=1e-6)
    assert seen and seen[-1] == 1.0
    wide = streaming_perplexity(tiny_model, text_ids[:80], "window:window=200", start=0)
    assert wide.exact and wide.start == 1 and wide.tokens == 79
    reference = streaming_perplexity(tiny_model, text_ids[:80], "full")
    assert math.isclose(wide.nll, reference.nll, rel_tol=1e-4)
    narrow = streaming_perplexity(tiny_model, text_ids[:80], "streaming_llm:sinks=2,window=16", start=40)
    assert narrow.exact and narrow.nll != pytest.approx(reference.nll)


def test_bad_requests(tiny_model, text_ids):
    with pytest.raises(ValueError, match="leaves no token"):
        streaming_perplexity(tiny_model, text_ids[:10], "full", start=10)
    with pytest.raises(SpecError, match="compresses a prompt once"):
        streaming_perplexity(tiny_model, text_ids[:50], "snapkv:budget=0.5")
    with pytest.raises(SpecError, match="unknown method"):
        streaming_perplexity(tiny_model, text_ids[:50], "nope")
