"""The trade-off sweep: families sized along every axis, the frontier, and points that equal compare's."""

import math

import pytest
import torch

from kvviz.comparison.batched import teacher_forced
from kvviz.comparison.session import compare
from kvviz.methods import Sizing, SpecError
from kvviz.studies.frontier import AGREEMENT, PERPLEXITY, on_frontier
from kvviz.studies.sweep import (
    SweepPoint,
    budget_reversals,
    family_specs,
    plan,
    read_family,
    run_sweep,
)
from kvviz.studies.workloads import PromptCase, PromptWorkload, TaskWorkload, TextWorkload, check_workload

SIZING = Sizing(prompt_length=1024, kv_heads=3, head_dim=64, bytes_per_element=4)
BUDGETS = [0.0625, 0.125, 0.25, 0.5]


def test_frontier_drops_dominated_points_and_keeps_ties():
    points = [(100, 0.9), (100, 0.9), (50, 0.5), (60, 0.4), (200, 0.9), (200, 1.0), (10, None), (None, 1.0)]
    assert on_frontier(points, AGREEMENT) == [True, True, True, False, False, True, False, False]


def test_frontier_reads_lower_as_better_for_perplexity():
    assert on_frontier([(100, 12.0), (50, 15.0), (80, 16.0), (300, 11.0)], PERPLEXITY) == [True, True, False, True]


def test_single_point_families_reach_the_frontier_only_when_nothing_beats_them():
    alone = on_frontier([(10, 0.3)], AGREEMENT)
    beaten = on_frontier([(10, 0.3), (5, 0.3)], AGREEMENT)
    assert alone == [True] and beaten == [False, True]


def test_with_paired_evidence_only_a_significantly_better_point_dominates():
    points = [(100, 0.9), (50, 0.95), (40, 0.5)]
    significant = {(1, 0)}  # only the 50-byte point is shown better than the 100-byte one
    flags = on_frontier(points, AGREEMENT, lambda i, j: (i, j) in significant)
    assert flags == [False, True, True], "the 40-byte point is worse but nothing smaller is shown better"
    assert on_frontier(points, AGREEMENT, lambda i, j: False) == [True, True, True], "no evidence, no domination"


def test_a_family_that_holds_more_at_a_smaller_budget_is_explained():
    def point(budget: float, held: int, unquantized: int | None = None) -> SweepPoint:
        return SweepPoint(f"s:{budget}", "snapkv+kivi", "stack", budget, held, 1000, full_precision_bytes=unquantized)

    steady = [point(0.5, 400), point(0.25, 300), point(0.125, 200)]
    assert budget_reversals(steady) == []
    (note,) = budget_reversals([point(0.5, 400), point(0.0625, 500, 450), point(0.125, 300)])
    assert note.startswith("snapkv+kivi holds more at budget 0.0625 (500 B) than at 0.125 (300 B): 90% of its bytes")


@pytest.mark.parametrize(("spec", "member", "swept", "kind"), [
    ("snapkv", "snapkv", ("budget",), "eviction"),
    ("kivi", "kivi", ("bits",), "quantization"),
    ("lowrank", "lowrank", ("rank",), "architecture"),
    ("merge_heads", "merge_heads", ("kv_heads",), "architecture"),
    ("snapkv+kivi:bits=4", "snapkv", ("budget",), "stack"),
    ("lowrank+snapkv:budget=0.25", "lowrank", ("rank",), "stack"),
    ("kvpress_native:press=knorm", "kvpress_native", ("compression_ratio",), "eviction"),
    ("snapkv:budget=256", None, (), "fixed"),
    ("fp8", None, (), "fixed"),
])
def test_a_family_frees_the_parameter_its_method_sizes(spec, member, swept, kind):
    family = read_family(spec)
    assert (family.member, family.swept, family.kind) == (member, swept, kind)


def test_a_family_swept_through_every_axis():
    tokens = family_specs(read_family("snapkv:window=8"), BUDGETS, SIZING)
    assert tokens == [(0.0625, "snapkv:budget=64,window=8"), (0.125, "snapkv:budget=128,window=8"),
                      (0.25, "snapkv:budget=256,window=8"), (0.5, "snapkv:budget=512,window=8")]
    bits = family_specs(read_family("kivi:residual=0"), BUDGETS, SIZING)
    assert [spec for _, spec in bits] == ["kivi:residual=0", "kivi:bits=4,residual=0", "kivi:bits=8,residual=0"]
    assert [share for share, _ in bits] == pytest.approx([3 / 32, 5 / 32, 9 / 32])  # codes + fp16 scale and zero
    latent = family_specs(read_family("lowrank"), BUDGETS, SIZING)
    assert [spec for _, spec in latent] == ["lowrank:rank=12", "lowrank:rank=24", "lowrank:rank=48", "lowrank"]
    heads = family_specs(read_family("merge_heads"), BUDGETS, SIZING)
    assert heads == [(pytest.approx(1 / 3), "merge_heads")]  # the one divisor of 3 below 3: a single point
    stack = family_specs(read_family("snapkv+kivi:bits=4"), [0.25], SIZING)
    assert stack == [(0.25, "snapkv:budget=256+kivi:bits=4")]
    native = family_specs(read_family("kvpress_native:press=knorm"), [0.25], SIZING)
    assert native == [(0.25, "kvpress_native:press=knorm,compression_ratio=0.75")]


def test_budgets_that_give_the_same_configuration_give_one_point():
    small = Sizing(prompt_length=8, kv_heads=3, head_dim=64, bytes_per_element=4)
    specs = [spec for _, spec in family_specs(read_family("streaming_llm"), [0.01, 0.02, 1.0], small)]
    assert len(specs) == len(set(specs)) == 2


@pytest.mark.parametrize(("specs", "budgets", "message"), [
    (["snapkv+kivi"], BUDGETS, "leaves snapkv's budget and kivi's bits free"),
    (["fp8", "snapkv:budget=256"], BUDGETS, "nothing to sweep: fp8, snapkv:budget=256 have no free parameter"),
    (["snapkv"], [0.25, 1.5], "budget 1.5 is outside (0, 1]"),
    (["snapkv"], [0.0], "budget 0 is outside (0, 1]"),
    (["nosuch"], BUDGETS, "unknown method 'nosuch'"),
])
def test_plan_refuses_with_one_line(specs, budgets, message):
    with pytest.raises((ValueError, SpecError), match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        plan(specs, budgets, SIZING)
    assert "\n" not in str(caught.value)


def test_unknown_task_is_one_line():
    with pytest.raises(ValueError, match="unknown task 'sudoku'; choose needle, multikey, multivalue, vartrack"):
        check_workload(TaskWorkload("sudoku"))


def test_fixed_configurations_join_a_sweep_as_one_point_each():
    _, points = plan(["snapkv", "fp8"], [0.25, 0.5], SIZING)
    assert [(family.spec, share, spec) for family, share, spec in points] == [
        ("snapkv", 0.25, "snapkv:budget=256"), ("snapkv", 0.5, "snapkv:budget=512"), ("fp8", None, "fp8")]


SAME_AS_COMPARE = ["snapkv", "snapkv+kivi:bits=4,residual=0", "kvpress_native:press=knorm", "streaming_llm"]


def test_a_sweep_point_equals_the_same_spec_run_alone_through_compare(real_model, story_ids):
    sizing = Sizing(len(story_ids), 3, 64, 4)
    specs = [spec for _, _, spec in plan(SAME_AS_COMPARE, [0.25], sizing)[1]]
    assert len(specs) == len(SAME_AS_COMPARE)
    forced = teacher_forced(real_model, story_ids, specs, 6)  # what run_sweep measures a prompt with
    assert [r.method for r in forced] == ["full", *specs]
    assert forced[0].agreement_with_full == 1.0 and forced[0].mean_kl == 0.0
    for point in forced[1:]:
        assert point.error is None, point.error
        full, alone = compare(real_model, story_ids, [point.method], 6).results
        assert alone.method == point.method
        assert point.agreement_with_full == alone.agreement_with_full
        assert point.first_divergence == alone.first_divergence
        assert math.isclose(point.mean_kl, alone.mean_kl, rel_tol=1e-3, abs_tol=1e-5)
        assert point.kv_bytes_full == full.kv_bytes
        if len(alone.token_ids) == len(full.token_ids):  # bytes and kept entries count the tokens fed
            assert point.kv_bytes == alone.kv_bytes
            if point.ledger is not None or alone.ledger is not None:  # the same entries in every layer and head
                assert torch.equal(point.ledger.evicted_at, alone.ledger.evicted_at), point.method


def test_the_frontier_and_summary_of_a_prompt_sweep(real_model, story_ids):
    report = run_sweep(real_model, PromptWorkload((PromptCase("story", "", tuple(story_ids)),), 4),
                       ["streaming_llm", "kivi:residual=0"], [0.125, 0.5])
    data = report.to_json()
    assert set(data) >= {"model", "prompt_tokens", "workload", "points"}
    assert data["prompt_tokens"] == len(story_ids)
    on = [p for p in report.points if p.frontier]
    assert on and all(p.agreement_with_full is not None for p in on)
    assert set(report.frontiers) == {"agreement_with_full", "mean_kl"}
    assert report.summary[-1].startswith("One prompt is a single example, not a benchmark: nothing can be proven")
    assert all(p.agreement_ci is None for p in report.points)  # nothing to resample
    assert all(p.paired.verdict != "within_margin" for p in report.points[1:]), "one prompt proves nothing"
    assert all(c is None or c.spec is None for c in report.cliffs.values())
    assert all(p.factors is not None for p in report.points)
    assert report.markdown().count("\n") == len(report.points) + 1


def test_a_text_sweep_reports_perplexity_and_refuses_prompt_only_evictions_per_point(tiny_model):
    report = run_sweep(tiny_model, TextWorkload("hamlet", 48), ["streaming_llm", "snapkv:budget=0.25"], [0.25])
    by_spec = {p.spec: p for p in report.points}
    assert by_spec["full"].perplexity > 0 and by_spec["full"].compression == 1.0
    assert by_spec["streaming_llm:window=8"].compression > 1.5
    assert "compresses a prompt once" in by_spec["snapkv:budget=0.25"].error
    assert all(p.agreement_with_full is None and p.accuracy is None for p in report.points)


def test_a_task_sweep_scores_every_item_full_included_and_pairs_each_point_with_full(real_model):
    report = run_sweep(real_model, TaskWorkload("needle", 192, 2), ["streaming_llm"], [0.0625])
    full, *points = report.points
    assert full.items_scored == 2 and full.paired is None and full.accuracy_ci is not None
    assert all(p.accuracy is not None and p.items_scored == 2 for p in report.points)
    for point in points:
        kinds = [o.versus_full for o in point.outcomes]
        assert point.paired.lost == kinds.count("lost") and point.paired.gained == kinds.count("gained")
        assert point.paired.items == 2 and point.paired.verdict != "within_margin", "two items prove nothing"
    assert min(p.compression for p in report.points) >= 1.0


def test_each_items_outcome_equals_that_item_run_alone_through_compare_and_its_ledger(real_model):
    """Every configuration of a wave of items decodes in one batch; each item's answer, score and evicted planted
    spans must be what that item alone through compare gives with the same SPEC (and its ledger says)."""
    from kvviz.studies.tail_attribution import span_fates
    from kvviz.studies.tail_items import NEW_TOKENS, stream_items

    report = run_sweep(real_model, TaskWorkload("multikey", 192, 3, seed=1), ["streaming_llm", "snapkv"], [0.25])
    items = {item.item_id: item for item in stream_items(real_model.tokenizer, "multikey", 192, range(3), seed=1)}
    checked = 0
    for point in report.points[1:]:
        assert point.error is None and point.outcomes, point.error
        for outcome in point.outcomes:
            item = items[outcome.item]
            alone = compare(real_model, item.ids, [point.spec], NEW_TOKENS["multikey"], reuse_prefix=False).results[-1]
            assert outcome.answer == alone.text.strip(), (point.spec, outcome.item)
            assert outcome.correct == all(item.score(alone.text).values())
            fates = span_fates(alone.ledger, item.spans)
            assert outcome.evicted == {f.label: len(f.evicted_layers) for f in fates if f.evicted}
            checked += 1
    assert checked == 2 * report.points[0].items_scored
    assert any(o.evicted for p in report.points[1:] for o in p.outcomes), "a quarter of the items evicts something"


def test_a_play_streams_every_configuration_together_as_each_streams_alone(tiny_model):
    from kvviz.studies.perplexity import play_text, streaming_perplexities, streaming_perplexity

    ids = tiny_model.tokenizer(play_text("hamlet"))["input_ids"][:40]
    specs = ["full", "streaming_llm:sinks=2,window=8", "h2o:heavy=4,recent=4", "kivi:bits=2,residual=0",
             "snapkv:budget=0.25"]
    together = streaming_perplexities(tiny_model, ids, specs)
    assert "compresses a prompt once" in str(together[-1])
    for spec, result in zip(specs[:-1], together, strict=False):
        alone = streaming_perplexity(tiny_model, ids, spec)
        assert result.tokens == alone.tokens == len(ids) - 1 and result.kv_bytes == alone.kv_bytes, spec
        assert result.per_token_nll == pytest.approx(alone.per_token_nll, rel=1e-4, abs=1e-4), spec


def test_a_prompt_set_with_answers_scores_accuracy_on_every_prompt_and_agreement_per_prompt(real_model):
    from kvviz.comparison.prompts import PromptLine
    from kvviz.lessons import STORY_QUESTION

    lines = [PromptLine("story", STORY_QUESTION, "Ines"),
             PromptLine("france", "What is the capital of France? Answer in one word.", "Paris"),
             PromptLine("nonsense", "Say only the word blue.", "a word full will not say")]
    workload = PromptWorkload.encode(real_model.tokenizer, lines, chat=True, max_new_tokens=8)
    report = run_sweep(real_model, workload, ["kivi:residual=0"], [0.25])
    full, *points = report.points
    assert set(report.frontiers) == {"accuracy", "agreement_with_full", "tail_share", "mean_kl"}
    right = sum(o.correct for o in full.outcomes)
    assert report.notes[0].startswith(f"The full cache's output holds the answer on {right} of 3 prompts")
    by_item = {o.item: o for o in full.outcomes}
    assert full.items_scored == 3 and full.accuracy == right / 3 and not by_item["nonsense"].correct
    for point in points:
        assert sorted(o.item for o in point.outcomes) == ["france", "nonsense", "story"], "every prompt scored"
        assert all(o.correct is not None for o in point.outcomes)
        assert point.agreement_ci is not None and point.agreement_ci[0] <= point.agreement_with_full
        assert point.worst_prompt_agreement == min(o.agreement for o in point.outcomes)
        assert point.tail_share == sum(o.agreement < 0.9 for o in point.outcomes) / 3 and point.tail_ci is not None
        assert point.paired.items == 3 and set(point.paired_by_measure) == {"accuracy", "agreement_with_full",
                                                                             "tail_share"}
    assert report.rules["answer"].startswith("correct when the expected answer appears in the output")
