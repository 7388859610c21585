"""The evidence behind a sweep's points: intervals, a recommendation that is a proof, prompt sets and their errors
(groups included), and items that come back the same."""

import pytest

from kvviz.comparison.prompts import PromptLine, parse_prompt_lines, read_prompt_set
from kvviz.comparison.session import PromptError
from kvviz.studies.intervals import bootstrap_mean, percentile, wilson
from kvviz.studies.sweep import SweepReport, check_sweep
from kvviz.studies.tail_items import item_from_id, stream_items
from kvviz.studies.verdicts import judged_report
from kvviz.studies.workloads import TaskWorkload, answer_found
from tests.test_paired import report_of, shuffled


def test_wilson_intervals_match_worked_examples():
    low, high = wilson(8, 10)  # the textbook example: 8 of 10
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson(10, 10) == pytest.approx((10 / (10 + 1.959964**2), 1.0))  # all right: n / (n + z^2) to 1
    assert wilson(0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)))
    low, high = wilson(26, 32)  # 32 items around 80%: -16/+10 points, as the default item count's comment says
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
    assert bootstrap_mean([0.1, 0.9], groups=["a", "a"]) is None, "one group has no spread either"
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8) and percentile([], 0.5) is None


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
    grouped = parse_prompt_lines("g.jsonl", '{"prompt": "Q1", "group": "doc"}\n{"prompt": "Q2", "group": 7}\n')
    assert [p.group for p in grouped] == ["doc", "7"]
    with pytest.raises(PromptError, match='line 1: "group" must be non-empty text or a number'):
        parse_prompt_lines("g.jsonl", '{"prompt": "Q1", "group": ""}')
    with pytest.raises(PromptError, match="a.txt has no answer while set.jsonl:1 has one"):
        read_prompt_set([("set.jsonl", b'{"prompt": "Q", "answer": "A"}'), ("a.txt", b"text")], 1000)
    assert [p.name for p in read_prompt_set([("a.txt", b"one"), ("b.md", b"two")], 1000)] == ["a.txt", "b.md"]


def test_items_come_back_the_same_from_a_seed_and_reopen_from_their_id(real_model):
    tokenizer = real_model.tokenizer
    first = stream_items(tokenizer, "multikey", 160, range(4), seed=3)
    assert [i.ids for i in first] == [i.ids for i in stream_items(tokenizer, "multikey", 160, range(4), seed=3)]
    assert [i.ids for i in stream_items(tokenizer, "multikey", 160, [2, 3], seed=3)] == [i.ids for i in first[2:]], \
        "item i is the same whatever else is asked for: a sweep can add items later"
    assert len({i.depth for i in first}) == 4 and all(0 < i.depth < 1 for i in first), "each its own random depth"
    assert len({tuple(i.ids) for i in first}) == 4, "every item its own key and filler"
    assert [i.ids for i in stream_items(tokenizer, "multikey", 160, range(4), seed=4)] != [i.ids for i in first]
    hops = [i.hops for i in stream_items(tokenizer, "vartrack", 160, range(12))]
    assert set(hops) == {1, 2}
    again = item_from_id(tokenizer, first[2].item_id, seed=3)
    assert again.ids == first[2].ids and again.expected == first[2].expected
    with pytest.raises(PromptError, match="'riddle:1:2' names no task item"):
        item_from_id(tokenizer, "riddle:1:2")


def test_the_server_limit_on_items_is_named():
    with pytest.raises(ValueError, match=r"600 items is more than this server allows \(512\); ask for at most 512"):
        check_sweep(["snapkv"], [0.25], TaskWorkload("needle", 256, 600), max_items=512)
    check_sweep(["snapkv"], [0.25], TaskWorkload("needle", 256, 200))  # the CLI has no server limit
    assert answer_found("Ines", "The winner is  INES.") and not answer_found("Paris", "Lyon")


def _laid_out(report: SweepReport, paged: dict[str, int]) -> SweepReport:
    """``report`` with each point's bytes in a paged layout too (SPEC -> bytes)."""
    for point in report.points:
        point.layout_bytes = {"counted": point.kv_bytes, "paged_shared": paged[point.spec]}
    return report


def _task_report(per_spec: dict[str, list[bool]]) -> SweepReport:
    return report_of(per_spec)


def test_the_frontier_is_found_again_on_the_memory_a_serving_layout_would_hold():
    """Counted, f:4 holds half of f:2's bytes and loses 15 of 40 items: both are on the frontier. A paged layout that
    frees nothing of f:4's blocks holds more for it than for f:2, which is significantly better: f:4 falls off."""
    right, _ = shuffled(40, 30, 0)
    outcomes = {"full": right, "f:2": right, "f:4": [False] * 15 + right[15:]}
    measured = _laid_out(_task_report(outcomes), {"full": 1000, "f:2": 600, "f:4": 990})
    counted, paged = judged_report(measured, 5, 0.9), judged_report(measured, 5, 0.9, "paged_shared")
    assert (counted.layout, paged.layout) == ("counted", "paged_shared")
    assert counted.frontiers["accuracy"] == ["full", "f:2", "f:4"]
    assert paged.frontiers["accuracy"] == ["full", "f:2"]
    assert [p.paired.to_json() for p in counted.points[1:]] == [p.paired.to_json() for p in paged.points[1:]], \
        "the verdicts against full do not depend on memory"


def test_the_recommendation_and_the_cliff_count_the_chosen_layout_s_bytes():
    """f:2 and f:4 are both proven within 5 points on 200 items. Counted, f:4 is the more compressed; paged, f:4's
    blocks barely free anything (1.01x) while f:2's free 40% (1.67x): deploy f:2, and the cliff is reached there."""
    full, _ = shuffled(200, 150, 0)
    measured = _laid_out(_task_report({"full": full, "f:2": full, "f:4": [False] + full[1:]}),
                         {"full": 1000, "f:2": 600, "f:4": 990})
    counted = " ".join(judged_report(measured, 5, 0.9).summary)
    paged = " ".join(judged_report(measured, 5, 0.9, "paged_shared").summary)
    assert "Deploy f:4: 4.0x smaller than full and proven" in counted and "up to 4.0x (f:4)." in counted
    assert "Deploy f:2: 1.7x smaller than full (paged, shared blocks) and proven" in paged
    assert "up to 1.7x (f:2). Compressions count what paged, shared blocks would hold." in paged
    table = judged_report(measured, 5, 0.9, "paged_shared").markdown()
    assert "| paged, shared blocks: bytes | paged, shared blocks: compression |" in table and "| 600 | 1.67x |" in table
    with pytest.raises(ValueError, match="no ledger"):
        judged_report(_task_report({"full": full, "f:2": full}), 5, 0.9, "paged_shared")
