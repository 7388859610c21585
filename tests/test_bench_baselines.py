"""The bench's baselines run under the padding of the kvviz path they are compared with: on a CPU a linear layer
pads a few rows unless its loop runs them as they come (kvviz.runtime.invariance), and a padded one-row step is up
to 1.3x slower, so a baseline padded beside kvviz's unpadded one-row decode would lean the ratio towards kvviz."""

import pytest
import torch

from kvviz.bench.sections.bookkeeping import dynamic_cache_step
from kvviz.bench.sections.replay_vs_generate import generate_tokens
from kvviz.bench.workloads import decode_step, prompt_tokens, random_model
from kvviz.comparison.session import PromptSession
from kvviz.runtime.invariance import RowPaddedLinear

PADDED_TO = 4  # every count of fewer rows is padded to it (as the probe pads a one-row step on the 2-core CPU)
PROMPT = 24


@pytest.fixture(scope="module")
def padded_model():
    """The tiny random model with every linear layer padding fewer than PADDED_TO rows, whatever the probe found."""
    loaded = random_model("tiny", "cpu")
    for module in loaded.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__class__, module.row_counts = RowPaddedLinear, (PADDED_TO, 32)
    return loaded


@pytest.fixture
def multiplied(monkeypatch) -> list[int]:
    """The row counts every linear layer multiplies from now on."""
    rows: list[int] = []
    plain = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda given, *weights: rows.append(given.numel() // given.shape[-1]) or plain(given, *weights))
    return rows


def test_kvviz_one_row_decode_multiplies_its_row_as_it_comes(padded_model, multiplied):
    session = PromptSession(padded_model, prompt_tokens(padded_model, PROMPT))
    session.prefill(None)
    multiplied.clear()
    decode_step(session, "full", 3)
    assert set(multiplied) == {1}


def test_generate_baseline_runs_its_one_row_steps_unpadded_as_kvviz_decode_does(padded_model, multiplied):
    ids = prompt_tokens(padded_model, PROMPT)
    tokens = generate_tokens(padded_model, ids, 3)
    assert set(multiplied) == {PROMPT, 1}, "the prompt's rows, then one row per step, none padded"
    multiplied.clear()
    assert generate_tokens(padded_model, ids, 3, padded=True) == tokens, "padding changes the time, not the tokens"
    assert PADDED_TO in multiplied, "the padded variant, reported beside it, really pads"


def test_dynamic_cache_floor_runs_its_one_row_steps_unpadded_as_kvviz_decode_does(padded_model, multiplied):
    dynamic_cache_step(padded_model, prompt_tokens(padded_model, PROMPT), 3)
    assert set(multiplied) == {PROMPT, 1}
    multiplied.clear()
    dynamic_cache_step(padded_model, prompt_tokens(padded_model, PROMPT), 3, padded=True)
    assert PADDED_TO in multiplied
