"""The needle harness: prompts built as promised, the key found with full, eviction reported from the ledger."""

import pytest
import torch

from kvviz.cache.ledger import EvictionLedger
from kvviz.comparison.session import PromptError, PromptSession
from kvviz.methods import REGISTRY
from kvviz.studies.needle import NeedleCell, build_needle_prompt, needle_eviction, run_needle_grid


def test_prompt_has_the_length_the_key_and_the_question_where_promised(real_model):
    tokenizer = real_model.tokenizer
    shallow = build_needle_prompt(tokenizer, 400, 0.1, seed=3)
    deep = build_needle_prompt(tokenizer, 400, 0.9, seed=3)
    assert 380 <= len(shallow.ids) <= 400 and shallow.key == deep.key and len(shallow.key) == 5
    digits = "".join(tokenizer.decode([shallow.ids[p]]).strip() for p in shallow.needle_positions)
    assert digits == shallow.key * 2
    assert max(shallow.needle_positions) < min(deep.needle_positions) < deep.question_start
    assert tokenizer.decode(shallow.ids[shallow.question_start:]).startswith("What is the pass key?")
    assert build_needle_prompt(tokenizer, 400, 0.1, seed=3, trial=1).key != shallow.key
    plain = build_needle_prompt(tokenizer, 300, 0.5, chat=False)
    assert tokenizer.decode(plain.ids).endswith("The pass key is")
    with pytest.raises(ValueError, match="too short"):
        build_needle_prompt(tokenizer, 20, 0.5)


def test_needle_eviction_reads_the_earliest_step_and_the_layers():
    ledger = EvictionLedger.empty(num_layers=3, kv_heads=2, prompt_length=10, capacity=12)
    assert needle_eviction(ledger, [4, 5]) == (True, None, [])
    ledger.record(2, 5, torch.tensor([[5], [6]]))
    ledger.record(0, 3, torch.tensor([[1], [4]]))
    assert needle_eviction(ledger, [4, 5]) == (False, 3, [0, 2])
    assert needle_eviction(None, [4]) == (True, None, [])


def test_suffix_tokens_are_fed_after_compression_like_part_of_the_prompt(tiny_model, story_ids):
    prompt, question = story_ids[:30], story_ids[30:36]
    whole, _ = PromptSession(tiny_model, prompt + question).run("full", 8)
    split, trace = PromptSession(tiny_model, prompt).run("full", 8, suffix_tokens=question)
    assert split.token_ids == whole.token_ids
    assert len(trace.kv_bytes_per_step) == 1 + len(question) + len(split.token_ids) - 1


def test_bad_grid_arguments_fail_before_any_work(tiny_model):
    for kwargs, message in [({"mode": "sideways"}, "mode"), ({"depths": [1.5]}, "depths"),
                            ({"lengths": [0]}, "lengths"), ({"trials": 0}, "trials")]:
        arguments = {"specs": ["full"], "lengths": [300], "depths": [0.5]} | kwargs
        with pytest.raises(PromptError, match=message):  # the user's mistake (the CLI exits 2), not a bug
            run_needle_grid(tiny_model, **arguments)


@pytest.mark.skipif("window" not in REGISTRY, reason="the window method has not landed yet")
def test_full_finds_the_key_and_the_ledger_shows_window_evicting_it(real_model):
    report = run_needle_grid(real_model, ["full", "window:window=64"], lengths=[360], depths=[0.3])
    full, window = report.cells
    assert full.found and full.survived and full.evicted_step is None and full.key in full.answer
    assert not window.survived and window.evicted_step == 0 and window.evicted_layers == list(range(30))
    assert not window.found
    assert window.needle_positions == full.needle_positions and window.prompt_tokens == full.prompt_tokens <= 360
    frame = report.to_frame()
    assert list(frame.columns) == list(NeedleCell.__dataclass_fields__) and len(frame) == 2
    data = report.to_json()
    assert data["summary"][0] == {"method": "full", "length": 360, "depth": 0.3, "trials": 1, "found": 1,
                                  "survived": 1}
    assert data["cells"][1]["evicted_layers"] == list(range(30))
    grid = ["depth \\ length        360"]
    assert report.lines()[1:] == ["", "== full", *grid, f"{'0.3':<16}{'1/1 ':>10}", "", "== window:window=64", *grid,
                                  f"{'0.3':<16}{'0/1*':>10}"]
