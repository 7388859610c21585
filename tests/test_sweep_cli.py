"""python -m kvviz sweep: the JSON schema, the Markdown rows, and every mistake as one line with exit code 2."""

import json
import math

import pytest

from kvviz.cli import main, options

POINT_KEYS = {"spec", "family", "budget", "kv_bytes", "compression", "agreement_with_full", "mean_kl", "accuracy",
              "perplexity", "frontier", "paired", "tail_share", "tail_ci", "items_used", "stopped", "stopped_at_look"}
PAIRED_KEYS = {"items", "units", "lost", "gained", "difference", "difference_ci", "p_value", "p_adjusted", "margin_p",
               "margin_p_adjusted", "beyond_p", "beyond_p_adjusted", "verdict", "bound", "bound_level", "margin",
               "units_needed", "exploratory"}


@pytest.mark.parametrize(("extra", "message"), [
    (["--task", "needle", "--method", "fp8"], "nothing to sweep: fp8 has no free parameter"),
    (["--task", "needle", "--method", "snapkv", "--budgets", "0.25,1.5"], "budget 1.5 is outside (0, 1]"),
    (["--task", "sudoku", "--method", "snapkv"], "unknown task 'sudoku'; choose needle, multikey, multivalue"),
    (["--task", "needle", "--method", "snapkv+kivi"], "leaves snapkv's budget and kivi's bits free"),
    (["--method", "snapkv"], "give the workload as --prompts FILE / --prompt-file FILE, --play NAME or --task TASK"),
    (["--task", "needle", "--items", "0", "--method", "snapkv"], "give at least one item"),
    (["--task", "needle"], "give at least one --method SPEC"),
    (["--task", "needle", "--method", "snapkv", "--budgets", "a,b"], "bad --budgets 'a,b'"),
    (["--task", "needle", "--method", "snapkv", "--margin", "0"], "--margin 0 is not a loss in points"),
    (["--task", "needle", "--method", "snapkv", "--margin", "100"], "--margin 100 is not a loss in points"),
    (["--task", "needle", "--method", "snapkv", "--adaptive", "--max-items", "0"], "needs at least one item"),
    (["--task", "needle", "--method", "snapkv", "--adaptive", "--time-budget", "0"], "give a number of seconds"),
    (["--task", "needle", "--method", "snapkv", "--time-budget", "60"], "--max-items and --time-budget go with"),
    (["--play", "hamlet", "--method", "snapkv", "--adaptive"], "a play is one stream of text, with no items"),
    (["--play", "hamlet", "--method", "snapkv", "--plan"], "--plan needs items: a play is one stream"),
    (["--play", "hamlet", "--method", "snapkv", "--layout", "paged_shared"], "a play's streaming perplexity keeps no"),
])
def test_mistakes_are_one_line_before_any_model_work(extra, message, capsys, monkeypatch):
    monkeypatch.setattr(options, "load", lambda args: pytest.fail("a mistake must be reported before loading a model"))
    assert main(["sweep", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_json_holds_every_point_with_the_schema_keys(tiny_model, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(options, "load", lambda args: tiny_model)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "sweep.json"
    code = main(["sweep", "--prompt-file", str(prompt), "--method", "streaming_llm", "--method", "fp8",
                 "--budgets", "0.125,0.5", "--max-new-tokens", "3", "--json", str(out), "--quiet", "--markdown"])
    assert code == 0
    data = json.loads(out.read_text())
    assert {"model", "prompt_tokens", "workload", "points"} <= set(data)
    sinks, n = 4, data["prompt_tokens"]  # streaming_llm sized: four sinks, the rest of the share a recent window
    assert [p["spec"] for p in data["points"]] == ["full", f"streaming_llm:window={math.ceil(n / 8) - sinks}",
                                                   f"streaming_llm:window={math.ceil(n / 2) - sinks}", "fp8"]
    for point in data["points"]:
        assert POINT_KEYS <= set(point)
        assert point["accuracy"] is None and point["perplexity"] is None  # measures of other workloads
        assert point["agreement_with_full"] is not None and point["kv_bytes"] > 0
    assert data["points"][-1]["budget"] is None and data["points"][-1]["family"] == "fp8"
    assert any(p["frontier"] for p in data["points"])
    assert data["points"][0]["paired"] is None and all(PAIRED_KEYS <= set(p["paired"]) for p in data["points"][1:])
    assert data["margin"] == 5.0 and data["plan"]["items"] == 1
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(data["points"])  # the header and one row per point


def test_a_bad_prompt_set_is_named_by_its_line_before_loading_a_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(options, "load", lambda args: pytest.fail("refused before loading a model"))
    bad = tmp_path / "set.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    assert main(["sweep", "--prompts", str(bad), "--method", "snapkv", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'set.jsonl' line 2 is not JSON" in err


def test_a_sweep_json_carries_intervals_outcomes_items_and_cliffs(real_model, tmp_path, monkeypatch, capsys):
    from kvviz.studies.tail_items import stream_items

    monkeypatch.setattr(options, "load", lambda args: real_model)
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--task", "needle", "--task-length", "160", "--items", "3", "--seed", "2", "--method",
                 "streaming_llm", "--budgets", "0.25", "--quiet", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [item["id"] for item in data["items"]] == [i.item_id for i in stream_items(real_model.tokenizer, "needle",
                                                                                      160, range(3), seed=2)]
    assert all(set(item) >= {"id", "prompt", "expected"} for item in data["items"])
    full, point = data["points"]
    right = sum(item["full_correct"] for item in data["items"])
    assert full["items_scored"] == point["items_scored"] == 3 and full["accuracy"] == pytest.approx(right / 3)
    assert len(point["accuracy_ci"]) == 2 and point["accuracy_ci"][0] <= point["accuracy"] <= point["accuracy_ci"][1]
    assert [o["item"] for o in point["outcomes"]] == [i["id"] for i in data["items"]]
    assert all(set(o) >= {"item", "correct", "evicted", "versus_full"} for o in point["outcomes"])
    kinds = [o["versus_full"] for o in point["outcomes"]]
    assert point["paired"]["lost"] == kinds.count("lost") and point["paired"]["gained"] == kinds.count("gained")
    (family,) = data["families"]
    assert family["spec"] == "streaming_llm" and family["cliff"]["family"] == "streaming_llm"
    assert data["rules"]["interval"].startswith("95% Wilson score interval") and "betting" in data["rules"]["paired"]
    assert data["plan"]["items"] == 3 and data["plan"]["fewest_items"] == 72 and not data["plan"]["adaptive"]
    assert point["items_used"] == 3 and point["stopped"] is None and data["item_cap"] is None
    printed = capsys.readouterr().out
    assert f"The full cache is right on {right} of 3 items" in printed and "3 items, one look" in printed


def test_json_carries_each_point_s_layout_bytes_for_the_block_size_given(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setattr(options, "load", lambda args: tiny_model)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--prompt-file", str(prompt), "--method", "streaming_llm", "--budgets", "0.25",
                 "--max-new-tokens", "2", "--block-size", "4", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["block_size"] == 4
    full, window = data["points"]
    for point in (full, window):
        assert point["layout_bytes"]["counted"] == point["kv_bytes"]
    assert full["layout_bytes"]["paged_shared"] >= full["kv_bytes"]
    held = window["layout_bytes"]
    assert held["counted"] <= held["paged_shared"] < full["layout_bytes"]["paged_shared"]
    assert data["layout"] == "counted"


def test_layout_counts_the_table_and_the_verdicts_in_a_serving_layout_s_bytes(tiny_model, monkeypatch, tmp_path,
                                                                              capsys):
    monkeypatch.setattr(options, "load", lambda args: tiny_model)
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Item {k}: the quick brown fox jumps over the lazy dog. " * 6})
                               + "\n" for k in range(3)))
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--prompts", str(prompts), "--method", "streaming_llm", "--budgets", "0.25",
                 "--max-new-tokens", "2", "--block-size", "4", "--layout", "paged_shared", "--json", str(out),
                 "--quiet"]) == 0
    data, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert data["layout"] == "paged_shared"
    full, window = data["points"]
    paged = full["layout_bytes"]["paged_shared"] / window["layout_bytes"]["paged_shared"]
    assert "paged_shared_compression" in printed and f"{paged:.4f}"[:5] in printed
    assert f", {paged:.1f}x smaller than full (paged, shared blocks), is inconclusive: 3 items cannot prove" in printed
    assert "Compressions count what paged, shared blocks would hold" in printed, "the cliff counts it too"


def test_an_adaptive_sweep_stops_decided_points_and_continues_from_the_store(real_model, tmp_path, monkeypatch):
    """Round 1 (16 items) proves a 1/16 window beyond the margin: it stops, and with nothing open the run ends. A
    point identical to full stays open to the cap; asked again with a larger cap, the run replays round 1 from the
    store and goes on."""
    monkeypatch.setattr(options, "load", lambda args: real_model)
    base = ["sweep", "--task", "multikey", "--task-length", "160", "--seed", "5", "--adaptive", "--quiet"]
    out = tmp_path / "window.json"
    assert main([*base, "--method", "streaming_llm", "--budgets", "0.0625", "--max-items", "64", "--json",
                 str(out)]) == 0
    data = json.loads(out.read_text())
    full, window = data["points"]
    assert (window["stopped"], window["stopped_at_look"], window["items_used"]) == ("beyond", 1, 16)
    assert window["paired"]["verdict"] == "beyond margin" and window["paired"]["bound"] < -0.05
    assert data["rounds"]["ended"] == "decided" and full["items_used"] == 16 and data["item_cap"] == 64
    assert [o["versus_full"] for o in window["outcomes"]].count("lost") == window["paired"]["lost"]
    assert data["margin_fixed"] == 5.0 and not data["exploratory"]
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    same = ["--method", "kivi:residual=0", "--budgets", "0.5"]  # 8 bits: as good as full on these items
    assert main([*base, *same, "--max-items", "16", "--json", str(first)]) == 0
    assert main([*base, *same, "--max-items", "32", "--json", str(second)]) == 0
    first, second = json.loads(first.read_text()), json.loads(second.read_text())
    eight_bits = next(point for point in first["points"] if point["spec"].startswith("kivi:bits=8"))
    assert eight_bits["stopped"] == "cap" and first["rounds"]["ended"] == "cap"
    assert (second["rounds"]["rounds"], second["rounds"]["reused"], second["rounds"]["items"]) == (2, 1, 32)
    assert second["points"][0]["outcomes"][:16] == first["points"][0]["outcomes"], "the same items, the same answers"


def test_a_one_second_budget_and_a_two_line_prompt_set_end_with_a_verdict_not_an_exception(tiny_model, monkeypatch,
                                                                                            tmp_path, capsys):
    """Hostile settings that still run: a time budget of one second ends an adaptive run once a round has shown
    what a round costs, and a prompt set of two lines is used up, every point inconclusive with the items it needs."""
    monkeypatch.setattr(options, "load", lambda args: tiny_model)
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "Name a planet."}\n{"prompt": "Name a colour."}\n')
    out = tmp_path / "two.json"
    assert main(["sweep", "--prompts", str(two), "--method", "streaming_llm", "--budgets", "0.5", "--adaptive",
                 "--time-budget", "1", "--max-new-tokens", "3", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["rounds"]["ended"] == "used up" and data["rounds"]["items"] == 2
    paired = data["points"][1]["paired"]
    assert paired["verdict"] == "inconclusive" and paired["units"] == 2 and paired["units_needed"] > 2
    printed = capsys.readouterr().out
    assert "2 items cannot prove the margin, however alike (at least 72 can)" in printed, printed
    timed = tmp_path / "timed.json"
    assert main(["sweep", "--task", "multikey", "--task-length", "160", "--method", "streaming_llm", "--budgets",
                 "0.5", "--adaptive", "--time-budget", "1", "--max-items", "256", "--json", str(timed), "--quiet"]) == 0
    rounds = json.loads(timed.read_text())["rounds"]
    assert rounds["ended"] == "time" and 16 <= rounds["items"] < 256, rounds
