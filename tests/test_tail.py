"""Tail tasks: prompts built as promised, exact scoring, attribution from the ledger, protection for every method."""

import pytest
import torch

from kvviz.cache.ledger import KEPT, EvictionLedger
from kvviz.cache.protect import with_protected
from kvviz.cache.storage import KeptRanges
from kvviz.comparison.session import PromptSession
from kvviz.methods import REGISTRY, SpecError, budget_spec, parse_spec
from kvviz.studies.tail import TailCell, run_tail
from kvviz.studies.tail_attribution import failure_cause, span_fates
from kvviz.studies.tail_items import MAX_HOPS, TASKS, Instruction, build_item

CASES = [(task, 0) for task in TASKS if task != "vartrack"] + [("vartrack", k) for k in range(1, MAX_HOPS + 1)]


@pytest.mark.parametrize(("task", "hops"), CASES)
def test_items_are_deterministic_per_seed_and_plant_what_they_claim(real_model, task, hops):
    tokenizer = real_model.tokenizer
    item = build_item(tokenizer, task, 300, 0.25, seed=4, hops=hops)
    again = build_item(tokenizer, task, 300, 0.25, seed=4, hops=hops)
    assert item == again and 270 <= len(item.ids) <= 300
    assert build_item(tokenizer, task, 300, 0.25, seed=5, hops=hops).ids != item.ids
    assert tokenizer(tokenizer.decode(item.ids), add_special_tokens=False)["input_ids"] == item.ids
    for span in item.spans:
        assert span.positions == list(range(span.positions[0], span.positions[-1] + 1)) or task == "needle"
        decoded = "".join(tokenizer.decode([item.ids[p]]) for p in span.positions)
        pieces = span.text.split(" ... ") if task == "needle" else [span.text]
        assert all(piece in decoded for piece in pieces), (span.label, decoded)
        if task != "needle":  # no more tokens than the text needs: dropping the first or the last loses some of it
            assert span.text not in "".join(tokenizer.decode([item.ids[p]]) for p in span.positions[1:])
            assert span.text not in "".join(tokenizer.decode([item.ids[p]]) for p in span.positions[:-1])
    question = tokenizer.decode(item.ids[item.question_start:])
    assert question.startswith(("What", "Follow", "In one sentence"))
    assert question.endswith(item.answer_prefix + ("" if item.answer_prefix else "\n"))
    if task == "instructions":
        assert len(item.spans) == 3 and all(max(s.positions) < item.context_start for s in item.spans)
        assert len(item.instructions) == 3 and item.expected == []
    else:
        assert all(item.context_start <= s.positions[0] < item.question_start for s in item.spans)
        assert all(any(value in s.text for s in item.spans) for value in item.expected)
    if task == "vartrack":
        assert len(item.spans) == hops and [s.role for s in item.spans] == ["hop"] * hops
        assert item.expected[0] in item.spans[0].text  # the chain starts at the value, in reading order
        assert item.answer_prefix.split()[-2] in item.spans[-1].text
    if task == "multikey":
        target = [s for s in item.spans if s.role == "target"]
        assert len(target) == 1 and item.expected[0] in target[0].text and len(item.spans) == 4
        assert target[0].label.split("'")[1] in question


def test_depth_moves_the_planted_spans_and_impossible_sizes_fail(real_model):
    tokenizer = real_model.tokenizer
    shallow = build_item(tokenizer, "multikey", 300, 0.1)
    deep = build_item(tokenizer, "multikey", 300, 0.9)
    target = [s for s in shallow.spans if s.role == "target"][0].positions[0]
    assert target < [s for s in deep.spans if s.role == "target"][0].positions[0]
    assert shallow.expected == deep.expected
    with pytest.raises(ValueError, match="too short"):
        build_item(tokenizer, "vartrack", 60, 0.5, hops=4)
    with pytest.raises(ValueError, match="hops"):
        build_item(tokenizer, "vartrack", 300, 0.5, hops=5)


@pytest.mark.parametrize(("kind", "target", "passes", "fails"), [
    ("lowercase", "", ["the river is calm.", "ok 42"], ["The river.", "", "   "]),
    ("uppercase", "", ["THE RIVER, 42!"], ["THE river", "..."]),
    ("start_word", "banana", ["Banana: the text is about mills.", "banana"], ["A banana.", "bananas are nice"]),
    ("end_word", "harbor", ["It ends at the harbor.", "HARBOR!"], ["harbor is here.", "the harbors"]),
    ("mention", "violin", ["A violin plays.", "the VIOLIN"], ["violins play", "no music"]),
    ("number", "482", ["I counted 482 geese.", "482"], ["4821 geese", "four hundred"]),
])
def test_instruction_checks_are_exact_on_crafted_answers(kind, target, passes, fails):
    rule = Instruction(kind, "", target)
    assert all(rule.check(answer) for answer in passes)
    assert not any(rule.check(answer) for answer in fails)


def test_scoring_checks_every_value_and_every_instruction(real_model):
    multivalue = build_item(real_model.tokenizer, "multivalue", 300, 0.5)
    first, second, third = multivalue.expected
    assert multivalue.score(f"They are {first}, {second} and {third}.") == dict.fromkeys(multivalue.expected, True)
    assert multivalue.score(f"{first} and {third}") == {first: True, second: False, third: True}
    rules = build_item(real_model.tokenizer, "instructions", 300, 0.0)
    checks = rules.score("")
    assert list(checks) == [f"{i + 1}:{r.kind}" for i, r in enumerate(rules.instructions)]
    assert not any(checks.values())


def test_attribution_matches_the_ledger_on_a_constructed_eviction(real_model):
    item = build_item(real_model.tokenizer, "vartrack", 300, 0.2, hops=3)
    ledger = EvictionLedger.empty(num_layers=4, kv_heads=2, prompt_length=len(item.ids), capacity=len(item.ids) + 8)
    hop2 = item.spans[1].positions
    ledger.record(3, 5, torch.tensor([[hop2[0]], [hop2[-1]]]))
    ledger.record(1, 2, torch.tensor([[hop2[1]], [0]]))
    ledger.record(2, 0, torch.tensor([[1], [2]]))  # not planted: no span's fate
    fates = span_fates(ledger, item.spans)
    assert [(f.label, f.evicted, f.evicted_step, f.evicted_layers) for f in fates] == [
        (item.spans[0].label, False, None, []), (item.spans[1].label, True, 2, [1, 3]),
        (item.spans[2].label, False, None, [])]
    assert failure_cause(item, {item.expected[0]: False}, fates, quantized=False) == "evicted"
    untouched = span_fates(None, item.spans)
    assert failure_cause(item, {item.expected[0]: False}, untouched, quantized=True) == "quantization"
    assert failure_cause(item, {item.expected[0]: False}, untouched, quantized=False) == "not evicted"
    rules = build_item(real_model.tokenizer, "instructions", 300, 0.0)
    ledger = EvictionLedger.empty(2, 1, len(rules.ids), len(rules.ids))
    ledger.record(0, 0, torch.tensor([rules.spans[1].positions]))
    fates = span_fates(ledger, rules.spans)
    first, second, third = (f"{i + 1}:{r.kind}" for i, r in enumerate(rules.instructions))
    assert failure_cause(rules, {first: False, second: True}, fates, False) == "not evicted"
    assert failure_cause(rules, {second: False, third: True}, fates, False) == "evicted"


def _small_spec(name: str) -> str:
    """A SPEC for eviction method ``name`` that must evict on a 64-token prompt (about 12 tokens kept)."""
    return budget_spec(name, 12, 64)


UNPROTECTABLE = {"adakv", "merge"}  # per-head counts / merged entries: protection is refused, with a message


@pytest.mark.parametrize("name", sorted(n for n, c in REGISTRY.items() if c.kind == "eviction" and n != "full"))
def test_protected_spans_are_never_evicted_by_any_registered_method(tiny_model, story_ids, name):
    spec = _small_spec(name)
    prompt = story_ids[:64]
    protect = [(2, 9), (30, 36)]
    protected = [p for start, end in protect for p in range(start, end)]
    session = PromptSession(tiny_model, prompt)
    if name in UNPROTECTABLE:
        with pytest.raises(SpecError, match="cannot protect spans"):
            session.run(spec, 10, protect=protect)
        return
    plain, _ = session.run(spec, 10)
    result, _ = session.run(spec, 10, protect=protect)
    assert (plain.ledger.evicted_at[..., protected] != KEPT).any(), f"{spec} should evict some protected token"
    assert (result.ledger.evicted_at[..., protected] == KEPT).all(), f"{spec} evicted a protected token"
    unprotected = [p for p in range(len(prompt)) if p not in protected]
    assert (result.ledger.evicted_at[..., unprotected] != KEPT).any(), f"{spec} stopped evicting anything"
    agnostic, _ = session.run(spec, 4, suffix_tokens=story_ids[64:70], protect=protect)
    assert (agnostic.ledger.evicted_at[..., protected] == KEPT).all()


def test_protection_keeps_positional_ranges_and_tops_up_heads_to_one_count():
    positions = torch.arange(10).expand(1, 2, 10)
    ranges = with_protected(KeptRanges(((0, 2), (7, 10)), 1, 2), positions, torch.tensor([4, 5]))
    assert isinstance(ranges, KeptRanges) and ranges.spans == ((0, 2), (4, 6), (7, 10))
    assert with_protected(KeptRanges(((0, 2), (4, 10)), 1, 2), positions, torch.tensor([2, 3])) is None
    index = torch.tensor([[[0, 4, 9], [0, 8, 9]]])  # head 0 already keeps 4, head 1 does not
    kept = with_protected(index, positions, torch.tensor([4]))
    assert kept.tolist() == [[[0, 4, 8, 9], [0, 4, 8, 9]]]  # head 0 topped up with its most recent dropped entry
    assert parse_spec("h2o:heavy=4,recent=4").eviction is not None


def test_short_real_run_calibrates_attributes_and_protects(real_model):
    report = run_tail(real_model, ["window:window=40"], ["needle", "vartrack", "instructions"], [200], [0.3],
                      hops=[1], protect=["system"])
    calibration = {c["task"]: c for c in report.calibration}
    assert calibration["needle"] == {"task": "needle", "generated": 1, "kept": 1, "unit": "items"}
    assert calibration["instructions"]["generated"] == 3 and calibration["instructions"]["unit"] == "instructions"
    methods = {c.method for c in report.cells}
    assert methods <= {"full", "window:window=40", "window:window=40 [protect system]"}
    needle = {c.method: c for c in report.cells if c.task == "needle"}
    assert needle["full"].correct and needle["full"].cause == "" and not needle["full"].lost
    window = needle["window:window=40"]
    assert not window.correct and window.cause == "evicted" and window.lost == ["pass key"]
    assert window.spans[0].evicted_step == 0 and window.spans[0].evicted_layers == list(range(30))
    assert len(window.evicted_share) == window.prompt_tokens and window.evicted_share[-1] == 0.0
    for cell in report.cells:
        if cell.protect == "system":
            item = next(i for i in report.items if i.item_id == cell.item_id)
            assert all(not f.evicted for f in cell.spans if f.role == "instruction")
            assert cell.evicted_share is None or not any(cell.evicted_share[: item.context_start])
    frame = report.to_frame()
    assert list(frame.columns) == [*TailCell.__dataclass_fields__, "task_label"] and len(frame) == len(report.cells)
    data = report.to_json()
    assert {"settings", "calibration", "summary", "cells", "items"} <= set(data)
    assert any(row["task"] == "needle" and row["method"] == "full" and row["accuracy"] == 1.0
               for row in data["summary"])
    assert "  window:window=40 on needle:200:0.3:0: evicted: pass key at step 0 in 30 layers; answer " in "\n".join(
        report.lines())


def test_tail_figures_order_tasks_and_mark_evicted_planted_tokens():
    import pandas as pd

    from kvviz_app import plots

    summary = pd.DataFrame([
        {"task": "vartrack k=2", "method": "full", "items": 2, "accuracy": 1.0},
        {"task": "needle", "method": "full", "items": 3, "accuracy": 1.0},
        {"task": "needle", "method": "snapkv:budget=64", "items": 3, "accuracy": 2 / 3},
        {"task": "vartrack k=2", "method": "snapkv:budget=64", "items": 2, "accuracy": 0.0},
    ])
    heatmap = plots.tail_heatmap(summary).data[0]
    assert list(heatmap.x) == ["needle", "vartrack k=2"] and list(heatmap.y) == ["full", "snapkv:budget=64"]
    assert heatmap.text[1] == ["67% (3)", "0% (2)"]
    contrast = plots.tail_contrast_figure(summary)
    assert [trace.name for trace in contrast.data] == ["needle", "vartrack k=2"]
    marked = plots.tail_context_html(["a", "b", "c", "d"], [0.0, 0.5, 1.0, 0.0], [("hop 1", [1]), ("hop 2", [3])])
    assert marked.count("rgba(214,39,40") == 1 and marked.count("rgba(44,160,44") == 1
    assert "line-through" in marked and "hop 1: evicted in 50%" in marked


def test_tail_cli_mistakes_exit_2_with_one_line_before_loading(capsys):
    from kvviz.cli import main

    assert main(["tail", "--tasks", "needle,riddles"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task(s) riddles" in err and "vartrack" in err
    assert main(["tail", "--method", "snapkv:budget=nope"]) == 2
    assert main(["tail", "--lengths", "abc"]) == 2
    assert "bad --lengths" in capsys.readouterr().err
