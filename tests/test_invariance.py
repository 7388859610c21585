"""On a CPU a row's numbers do not depend on the batch it runs in (kvviz.runtime.invariance): a run decoded alone or
beside another user's run gives the very same logits, not just the same tokens."""

import contextlib

import torch

from kvviz.comparison.session import compare, encode_prompt
from kvviz.lessons import STORY_QUESTION
from kvviz.runtime.invariance import PROBE_ROWS, RowPaddedLinear, agreeing_row_counts, rows_as_they_come
from kvviz.runtime.threads import small_work
from tests.test_together import together

COMPARE_DEFAULTS = ["full", "streaming_llm:window=0.25", "snapkv:budget=0.25,window=8", "kivi:residual=0"]


def assert_bitwise_equal(ours, theirs):
    """Same tokens and the very same teacher-forced KL per step (no tolerance)."""
    for mine, other in zip(ours.results, theirs.results, strict=True):
        assert mine.error is None and other.error is None, mine.method
        assert mine.token_ids == other.token_ids, mine.method
        assert mine.kl_per_step == other.kl_per_step, mine.method


def test_every_linear_layer_gives_a_row_the_same_numbers_in_a_batch_of_any_size(real_model):
    linears = [module for module in real_model.model.modules() if isinstance(module, torch.nn.Linear)]
    assert real_model.row_counts is not None and all(type(m) is RowPaddedLinear for m in linears)
    assert set(real_model.row_counts) <= set(agreeing_row_counts(linears))
    assert real_model.row_counts[-1] == PROBE_ROWS
    shapes = {(m.in_features, m.out_features): m for m in linears}
    rows = torch.randn(40, 1, max(m.in_features for m in linears), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for threads in (contextlib.nullcontext(), small_work(real_model.device)):  # a prefill's, a decode step's
            with threads:
                for linear in shapes.values():
                    given = rows[..., :linear.in_features]
                    in_one_batch = linear(given)
                    for count in [*range(1, 26), 33]:  # [count, 1, features], as a decode step feeds its rows
                        assert torch.equal(linear(given[:count]), in_one_batch[:count]), (linear, count)


def test_one_row_loops_multiply_their_row_as_it_comes(real_model, monkeypatch):
    """The one-method-at-a-time decode and streaming perplexity feed one row that never shares a forward: it keeps
    the single row's own kernel (faster than any padded count on this CPU); everywhere else one row is padded."""
    multiplied: list[int] = []
    plain = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda rows, *weights: multiplied.append(rows.shape[0]) or plain(rows, *weights))
    linear = real_model.model.lm_head
    row = torch.randn(1, linear.in_features)
    with torch.inference_mode():
        linear(row)
        with rows_as_they_come():
            linear(row)
    assert multiplied == [real_model.row_counts[0], 1]


def test_runs_decoding_beside_another_users_run_equal_themselves_alone_bit_for_bit(real_model):
    """Compare's defaults on the lesson story (where the 2-bit cache once chose another token after 10 steps, when
    rows were multiplied in another count) beside a one-row run, which multiplies its row alone when it runs alone."""
    tokenizer = real_model.tokenizer
    defaults = {"prompt_ids": encode_prompt(tokenizer, STORY_QUESTION, chat=True), "specs": COMPARE_DEFAULTS,
                "max_new_tokens": 16, "reuse_prefix": False}
    one_row = {"prompt_ids": encode_prompt(tokenizer, "Name three rivers.", chat=True), "specs": ["full"],
               "max_new_tokens": 6, "reuse_prefix": False}
    decoder = real_model.engine
    shared = decoder.shared_forwards
    outcomes = together(real_model, [defaults, one_row])
    assert decoder.shared_forwards > shared, "the two runs decoded in the same forwards"
    for outcome, run in zip(outcomes, (defaults, one_row), strict=True):
        assert_bitwise_equal(outcome, compare(real_model, **run))
    assert "Ines" in outcomes[0].by_method("full").text
