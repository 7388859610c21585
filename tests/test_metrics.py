"""Teacher-forced quality numbers: full agrees with itself exactly; a destructive method visibly does not."""

import math

import pytest
import torch

from kvviz.comparison.metrics import forced_comparison, kl_per_step
from kvviz.comparison.session import PromptSession, compare
from kvviz.methods import REGISTRY


def _logprobs(rows):
    return [torch.log_softmax(torch.tensor(row, dtype=torch.float32), dim=-1) for row in rows]


def test_identical_distributions_agree_with_zero_kl():
    steps = _logprobs([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    scores = forced_comparison(steps, steps)
    assert scores.agreement == 1.0 and scores.first_divergence is None
    assert scores.kl_per_step == [0.0, 0.0] and scores.mean_kl == 0.0


def test_kl_matches_the_definition_and_top1_disagreement_is_located():
    reference = _logprobs([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 0.0]])
    candidate = _logprobs([[2.0, 1.0, 0.0], [3.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    scores = forced_comparison(reference, candidate)
    p, q = reference[1].exp(), candidate[1].exp()
    expected = float((p * (p.log() - q.log())).sum())
    assert scores.kl_per_step[0] == 0.0 and math.isclose(scores.kl_per_step[1], expected, rel_tol=1e-5)
    assert scores.first_divergence == 1 and scores.agreement == pytest.approx(2 / 3)
    assert kl_per_step([], []) == []


def test_teacher_forcing_full_on_its_own_tokens_reproduces_its_distributions(tiny_model, story_ids):
    session = PromptSession(tiny_model, story_ids[:40])
    free, free_trace = session.run("full", 12, keep_logprobs=True)
    _, forced_trace = session.run("full", 12, forced_tokens=free.token_ids, keep_logprobs=True)
    scores = forced_comparison(free_trace.step_logprobs, forced_trace.step_logprobs)
    assert len(forced_trace.step_logprobs) == len(free.token_ids)
    assert scores.agreement == 1.0 and scores.mean_kl == 0.0 and scores.first_divergence is None


def test_compare_reports_full_against_itself(tiny_model, story_ids):
    result = compare(tiny_model, story_ids[:40], ["full"], max_new_tokens=10).results[0]
    assert result.agreement_with_full == 1.0 and result.first_divergence is None
    assert result.mean_kl == 0.0 and result.kl_per_step == [0.0] * len(result.token_ids)
    data = result.to_json()
    assert data["mean_kl"] == 0.0 and len(data["kl_per_step"]) == len(result.token_ids)


@pytest.mark.skipif("window" not in REGISTRY, reason="the window method has not landed yet")
def test_a_destructive_window_shows_low_agreement_and_high_kl(real_model, story_ids):
    comparison = compare(real_model, story_ids, ["full", "window:window=8"], max_new_tokens=12)
    full, window = comparison.results
    assert full.agreement_with_full == 1.0 and full.mean_kl == 0.0
    assert window.error is None, window.error
    assert window.text  # its own free-running output is still shown
    assert window.agreement_with_full < 0.5 and window.mean_kl > 1.0
    assert window.first_divergence is not None and window.first_divergence < 4
    assert len(window.kl_per_step) == len(full.token_ids)  # teacher-forced on full's tokens
