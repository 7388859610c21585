"""The Prefix-reuse study (kvviz.studies.prefix_reuse): turns through one prefix cache, preamble edits, the page and
the CLI showing what the engine measured."""

from __future__ import annotations

from kvviz.runtime.prefix import block_hashes
from kvviz.studies.prefix_reuse import DEFAULT_QUESTIONS, default_preamble, edit_preamble, run_turns, turn_ids


def test_turns_sharing_a_preamble_hit_every_preamble_block(tiny_model, story_ids):
    preamble = story_ids[:80]
    report = run_turns(tiny_model, [preamble + story_ids[90:100], preamble + story_ids[100:112]])
    first, second = report.turns
    assert first.lookup.hits == 0 and second.lookup.hits == 5
    assert second.max_logit_diff < 1e-4 and second.same_next_token


def test_real_model_reuse_is_exact(real_model, story_ids):
    preamble = story_ids[:160]
    report = run_turns(real_model, [preamble + story_ids[170:190], preamble + story_ids[190:215]])
    assert report.turns[1].lookup.reused_tokens == 160
    assert report.turns[1].max_logit_diff < 1e-3


SHORT_PREAMBLE = (
    "<|im_start|>system\nYou are Harbourmaster, the ferry help desk. Answer in one short sentence.\n"
    "Ferries leave Port Ellen for the Rock at 07:15, 10:30, 14:00 and 18:45 in summer.\n"
    "A bicycle costs 3 pounds, a kayak 8 pounds, an adult single 14 pounds.\n"
    "Every vessel has a lift and two accessible toilets; wheelchair users board first.<|im_end|>\n"
)


def test_prefix_page_figures_equal_the_engines(monkeypatch, tmp_path, real_model):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from kvviz.studies.prefix_sharing import compare_sharing

    preamble_file = tmp_path / "preamble.txt"
    preamble_file.write_text(SHORT_PREAMBLE, encoding="utf-8")
    monkeypatch.setattr("kvviz.studies.prefix_reuse.PREAMBLE_FILE", preamble_file)
    spec = "streaming_llm:sinks=4,window=24,rerotate=0"
    app = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "views" / "7_Prefix_reuse.py"),
                            default_timeout=900)
    app.query_params["len"] = ["128"]
    app.query_params["m"] = [spec]
    app.query_params["n"] = "3"
    app.run()
    assert not app.exception and not app.get("plotly_chart"), "nothing runs before the button is pressed"
    next(b for b in app.button if b.label == "Run prefix reuse").click().run()
    assert len(app.get("plotly_chart")) == 3, "the turns and byte stability; the later sections wait for their buttons"
    for label in ("Compress the preamble for A and B (2 runs)", "Prefill 1 length"):
        next(b for b in app.button if b.label == label).click().run()
    assert not app.exception and not app.error, [e.value for e in app.error]
    assert len(app.get("plotly_chart")) == 5  # block table, TTFT, stability table, Jaccard, context cost

    tokenizer = real_model.tokenizer
    pieces = [turn_ids(tokenizer, SHORT_PREAMBLE, q) for q in DEFAULT_QUESTIONS]
    edited = turn_ids(tokenizer, edit_preamble(SHORT_PREAMBLE, "timestamp", 1), DEFAULT_QUESTIONS[-1])
    prompts = [p + q for p, q in pieces] + [edited[0] + edited[1]]
    engine = run_turns(real_model, prompts, block_tokens=16)
    shown = app.dataframe[0].value
    assert list(shown["hit_blocks"]) == [t.lookup.hits for t in engine.turns[:-1]]
    assert list(shown["reused_tokens"]) == [t.lookup.reused_tokens for t in engine.turns[:-1]]
    assert engine.turns[1].lookup.hits == len(pieces[0][0]) // 16
    metrics = {m.label: m.value for m in app.metric}
    edited_turn = engine.turns[-1]
    assert metrics["Blocks reused after the edit"] == f"{edited_turn.lookup.hits} / {len(edited_turn.lookup.blocks)}"
    assert edited_turn.lookup.hits < engine.turns[1].lookup.hits

    sharing = compare_sharing(real_model, pieces[0][0], pieces[0][1], pieces[1][1], [spec], 3)
    table = app.dataframe[1].value
    assert list(table["Jaccard (mean)"]) == [r.jaccard for r in sharing.rows]
    assert list(table["shareable"]) == [r.shareable for r in sharing.rows]


def test_cli_prefix_refuses_a_method_that_does_not_evict(capsys):
    from kvviz.cli import main

    assert main(["prefix", "--method", "kivi:bits=2", "--quiet"]) == 2
    assert "prefix sharing compares eviction methods" in capsys.readouterr().err


def test_cli_prefix_json_to_stdout_is_the_json_alone(tiny_model, monkeypatch, capsys, tmp_path):
    import json

    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    preamble = tmp_path / "preamble.txt"
    preamble.write_text(SHORT_PREAMBLE, encoding="utf-8")
    assert cli.main(["prefix", "--preamble-file", str(preamble), "--method", "streaming_llm:sinks=4,window=24",
                     "--max-new-tokens", "2", "--quiet", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_tokens"] == 16 and len(data["turns"]) == len(data["block_tables"]) == 2
    assert len(data["sharing"]) == 2 and all(row["method"].startswith("streaming_llm") for row in data["sharing"])
    assert data["turns"][1]["hit_blocks"] == data["preamble_tokens"] // 16


def test_edits_change_every_block_from_the_edit_on(real_model):
    tokenizer = real_model.tokenizer
    original = default_preamble()
    late = len(original.split("\n")) - 3
    for edit, line, changed_early in (("timestamp", 1, True), ("reorder", late, False)):
        before = block_hashes(tokenizer(original)["input_ids"])
        after = block_hashes(tokenizer(edit_preamble(original, edit, line))["input_ids"])
        first = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        assert (first < 3) == changed_early
        assert all(a != b for a, b in zip(before[first:], after[first:], strict=False))
