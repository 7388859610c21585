"""The evidence behind a sweep's points: intervals, the cliff, a recommendation that never ranks what its intervals
cannot separate, prompt sets and their errors, and items that come back the same."""

import pytest

from kvviz.engine.prompts import PromptLine, parse_prompt_lines, read_prompt_set
from kvviz.engine.session import PromptError
from kvviz.studies.frontier import ACCURACY, Candidate, Cliff, find_cliff, recommendation
from kvviz.studies.intervals import bootstrap_mean, overlap, percentile, wilson
from kvviz.studies.sweep import check_sweep
from kvviz.studies.tail_items import item_from_id, spread_items
from kvviz.studies.workloads import TaskWorkload, answer_found


def test_wilson_intervals_match_worked_examples():
    low, high = wilson(8, 10)  # the textbook example: 8 of 10
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson(10, 10) == pytest.approx((10 / (10 + 1.959964**2), 1.0))  # all right: n / (n + z^2) to 1
    assert wilson(0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)))
    low, high = wilson(26, 32)  # 32 items around 80%: about ±14 points, as the default item count promises
    assert (round(low, 2), round(high, 2)) == (0.65, 0.91) and high - low < 0.30
    assert wilson(0, 0) is None
    with pytest.raises(ValueError):
        wilson(11, 10)


def test_the_bootstrap_interval_matches_its_enumerated_distribution():
    # four prompts agreeing 0, 1, 1, 1: a resample's mean is k/4 with k ~ Binomial(4, 3/4) ones; P(k = 0) = 0.4% and
    # P(k <= 1) = 5.1%, so the 2.5th percentile is 1/4; P(k = 4) = 32%, so the 97.5th is 1
    assert bootstrap_mean([0.0, 1.0, 1.0, 1.0]) == (0.25, 1.0)
    assert bootstrap_mean([0.7, 0.7, 0.7]) == pytest.approx((0.7, 0.7))
    assert bootstrap_mean([0.2, 0.9, 0.4]) == bootstrap_mean([0.2, 0.9, 0.4]), "a fixed seed: the same interval"
    assert bootstrap_mean([0.5]) is None, "one prompt has no spread to resample"
    assert overlap((0.1, 0.5), (0.5, 0.9)) and not overlap((0.1, 0.49), (0.5, 0.9)) and not overlap(None, (0, 1))
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8) and percentile([], 0.5) is None


def test_the_cliff_is_the_last_point_like_full_before_the_first_that_is_not():
    points = [("b", 4.0, True), ("a", 2.0, True), ("c", 8.0, False), ("d", 16.0, True)]
    assert find_cliff("f", points) == Cliff("f", "b", 4.0, "c", 8.0), "d, past the fall, does not move it"
    assert find_cliff("f", [("a", 2.0, True), ("b", 4.0, True)]) == Cliff("f", "b", 4.0)
    assert find_cliff("f", [("a", 2.0, False), ("b", 4.0, True)]) == Cliff("f", None, None, "a", 2.0)
    assert find_cliff("f", [("a", 2.0, True), ("b", 4.0, None)]) is None, "no interval: nothing to tell"
    assert find_cliff("f", []) is None
    assert Cliff("f", "b", 4.0, "c", 8.0).sentence() == ("f's cliff: indistinguishable from full at this sample "
                                                         "size up to 4.0x (b); at 8.0x (c) it is not.")
    assert "at every budget measured, up to 4.0x (b)" in Cliff("f", "b", 4.0).sentence()
    assert "already at its least compressed point, 2.0x (a)" in Cliff("f", None, None, "a", 2.0).sentence()


def test_the_recommendation_never_ranks_configurations_whose_intervals_overlap():
    like = [Candidate("a", "eviction", 4.1, 0.90, (0.80, 0.97), True),
            Candidate("b", "quantization", 4.5, 0.85, (0.70, 0.93), True)]
    (line, *_) = recommendation(like, ACCURACY, "On 32 items")
    assert line == ("On 32 items, at 2x smaller than full or more, indistinguishable from full at this sample size: "
                    "b (85% [70, 93]), a (90% [80, 97]).")  # most compressed first, whatever the means say
    apart = [Candidate("c", "eviction", 8.0, 0.60, (0.45, 0.74), False),
             Candidate("d", "stack", 9.0, 0.50, (0.35, 0.65), False),
             Candidate("e", "quantization", 8.5, 0.10, (0.03, 0.25), False)]
    lines = recommendation(apart, ACCURACY, "On 32 items")
    assert lines[2] == ("On 32 items, at 8x smaller than full or more, nothing is indistinguishable from full at this "
                        "sample size; the best measured is c (60% [45, 74]), and cannot be told apart from d (50% "
                        "[35, 65]); 1 other falls below its interval.")
    zero = [Candidate("f", "eviction", 16.0, 0.0, (0.0, 0.14), False), Candidate("g", "stack", 17.0, 0.0, (0.0, 0.14),
                                                                                 False)]
    assert recommendation(zero, ACCURACY, "On 32 items")[-1].endswith(
        "nothing is indistinguishable from full at this sample size; every configuration there scores 0%.")


def test_a_prompt_set_file_names_the_line_at_fault():
    good = parse_prompt_lines("set.jsonl", '{"prompt": "Q1", "answer": "A1"}\n\n{"prompt": "Q2", "answer": 42}\n')
    assert good == [PromptLine("set.jsonl:1", "Q1", "A1"), PromptLine("set.jsonl:3", "Q2", "42")]
    for text, said in (('{"prompt": "Q1"}\n{"prompt": "Q2"', "'set.jsonl' line 2 is not JSON"),
                       ('{"prompt": "Q1"}\n["Q2"]', "'set.jsonl' line 2 has no \"prompt\""),
                       ('{"question": "Q1"}', "'set.jsonl' line 1 has no \"prompt\""),
                       ('{"prompt": "  "}', "'set.jsonl' line 1: \"prompt\" must be non-empty text"),
                       ('{"prompt": "Q", "answer": ["x"]}', "line 1: \"answer\" must be non-empty text or a number"),
                       ("\n\n", "'set.jsonl' holds no prompt")):
        with pytest.raises(PromptError, match=said.replace("(", r"\(")):
            parse_prompt_lines("set.jsonl", text)
    with pytest.raises(PromptError, match="'b.txt' is 0.0 MB; the limit is 0.0 MB|'b.txt' is .* the limit is"):
        read_prompt_set([("a.txt", b"short"), ("b.txt", b"x" * 200)], 100)  # the file over the limit is named
    with pytest.raises(PromptError, match="a.txt has no answer while set.jsonl:1 has one"):
        read_prompt_set([("set.jsonl", b'{"prompt": "Q", "answer": "A"}'), ("a.txt", b"text")], 1000)
    assert [p.name for p in read_prompt_set([("a.txt", b"one"), ("b.md", b"two")], 1000)] == ["a.txt", "b.md"]


def test_items_come_back_the_same_from_a_seed_and_reopen_from_their_id(real_model):
    tokenizer = real_model.tokenizer
    first = spread_items(tokenizer, "multikey", 160, 4, seed=3)
    assert [i.ids for i in first] == [i.ids for i in spread_items(tokenizer, "multikey", 160, 4, seed=3)]
    assert [i.depth for i in first] == [0.125, 0.375, 0.625, 0.875]
    assert len({tuple(i.ids) for i in first}) == 4, "every item its own key and filler"
    assert [i.ids for i in spread_items(tokenizer, "multikey", 160, 4, seed=4)] != [i.ids for i in first]
    assert [i.hops for i in spread_items(tokenizer, "vartrack", 160, 3)] == [1, 2, 1]
    again = item_from_id(tokenizer, first[2].item_id, seed=3)
    assert again.ids == first[2].ids and again.expected == first[2].expected
    with pytest.raises(PromptError, match="'riddle:1:2' names no task item"):
        item_from_id(tokenizer, "riddle:1:2")


def test_the_server_limit_on_items_is_named():
    with pytest.raises(ValueError, match=r"200 items is more than this server allows \(128\); ask for at most 128"):
        check_sweep(["snapkv"], [0.25], TaskWorkload("needle", 256, 200), max_items=128)
    check_sweep(["snapkv"], [0.25], TaskWorkload("needle", 256, 200))  # the CLI has no server limit
    assert answer_found("Ines", "The winner is  INES.") and not answer_found("Paris", "Lyon")
