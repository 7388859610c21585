"""The CLI: one-line errors with exit code 2, info as JSON, compare's JSON schema."""

import json
import subprocess
import sys

import pytest

from kvviz.cli import main


def test_bad_spec_exits_2_with_one_line(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    code = main(["compare", "--prompt-file", str(prompt), "--method", "nosuch:x=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "unknown method 'nosuch'" in err and "valid:" in err


def test_missing_prompt_file_exits_2(capsys):
    assert main(["compare", "--prompt-file", "/nonexistent/prompt.txt"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_compare_needs_exactly_one_prompt_source(capsys):
    assert main(["compare"]) == 2
    assert "--prompt-file FILE or --play NAME" in capsys.readouterr().err


def test_a_study_argument_the_model_cannot_run_exits_2_with_one_line(tiny_model, monkeypatch, capsys):
    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    assert main(["needle", "--lengths", "64", "--depths", "0.5", "--mode", "sideways", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown needle mode 'sideways'" in err


def test_an_unwritable_json_path_exits_2_with_one_line(tiny_model, monkeypatch, capsys, tmp_path):
    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    out = tmp_path / "no such folder" / "out.json"
    assert main(["compare", "--play", "hamlet", "--play-tokens", "20", "--max-new-tokens", "1", "--quiet",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {out}" in err


@pytest.mark.parametrize("bug", [ValueError, RuntimeError])
def test_a_bug_exits_1_with_its_traceback_not_as_a_user_mistake(monkeypatch, capsys, bug):
    def broken(cls):
        raise bug("an internal bug")

    monkeypatch.setattr("kvviz.runtime.settings.Settings.from_env", classmethod(broken))
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and f"{bug.__name__}: an internal bug" in err


def test_a_bug_in_the_engine_during_a_run_exits_1_with_its_traceback(tiny_model, monkeypatch, capsys):
    from kvviz import cli

    def broken(*args, **kwargs):
        raise ValueError("a bug in the engine")

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    monkeypatch.setattr("kvviz.comparison.session.encode_prompt", broken)
    assert main(["compare", "--play", "hamlet", "--play-tokens", "20", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: a bug in the engine" in err


def test_compare_prints_a_markdown_table_from_a_play_excerpt(tiny_model, monkeypatch, capsys):
    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    code = main(["compare", "--play", "hamlet", "--play-tokens", "60", "--question", "Who is there?",
                 "--method", "full", "--method", "window:window=16+fp8", "--max-new-tokens", "3", "--quiet",
                 "--markdown"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| method | KV bytes | vs full | agreement | mean KL (nats) | first divergence |" in printed
    prompt_tokens = int(printed.split("prompt ")[1].split(" tokens")[0])
    assert 60 < prompt_tokens < 72  # 60 of the play, a blank line and the question (retokenized)
    assert "| `full` | " in printed and "1.00x | 1.00 | 0.000 | - |" in printed
    assert "| `window:window=16+fp8` | " in printed


def test_unknown_model_exits_2(capsys):
    assert main(["info", "--model", "not a model!"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_info_json_and_compare_json_end_to_end(tmp_path):
    """Runs the real CLI in a subprocess, as a user would."""
    info = subprocess.run([sys.executable, "-m", "kvviz", "info", "--json"], capture_output=True, text=True,
                          check=True)
    card = json.loads(info.stdout)
    assert (card["layers"], card["q_heads"], card["kv_heads"], card["head_dim"]) == (30, 9, 3, 64)
    assert card["attention"] == "GQA" and "2 * 30 layers * 3 kv_heads * 64 head_dim" in card["kv_formula"]

    prompt = tmp_path / "p.txt"
    prompt.write_text("Name a color of the rainbow.")
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-m", "kvviz", "compare", "--prompt-file", str(prompt), "--chat",
                    "--method", "full", "--max-new-tokens", "8", "--json", str(out), "--quiet"],
                   capture_output=True, text=True, check=True)
    data = json.loads(out.read_text())
    assert set(data) >= {"model", "device", "prompt_tokens", "results"}
    result = data["results"][0]
    assert set(result) >= {"method", "text", "token_ids", "kv_bytes", "kv_bytes_full", "seconds",
                           "agreement_with_full", "first_divergence"}
    assert result["method"] == "full" and result["kv_bytes"] == result["kv_bytes_full"]
    assert len(result["token_ids"]) <= 8


def test_the_comparison_prints_as_text_each_method_with_its_bytes_or_its_failure():
    from kvviz.comparison.results import Comparison, MethodResult

    comparison = Comparison("m", "cpu", 10, list(range(10)), 0.5, [
        MethodResult("full", text="an answer", kv_bytes=4096, kv_bytes_full=4096, seconds=0.25,
                     agreement_with_full=1.0),
        MethodResult("window:window=4", error="out of memory")])
    assert comparison.lines() == ["model m on cpu, prompt 10 tokens, prefill 0.50s", "",
                                  "== full: kv 4,096 B vs full 4,096 B 1.00x smaller, agreement 1.00, 0.25s",
                                  "an answer", "", "== window:window=4: FAILED: out of memory"]
    assert comparison.to_markdown().splitlines()[-1] == "| `window:window=4` | failed: out of memory | | | | |"


def test_compare_json_carries_each_configuration_s_layout_bytes_and_the_block_size(tiny_model, monkeypatch, capsys,
                                                                                    tmp_path):
    from kvviz import cli

    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    out = tmp_path / "out.json"
    assert main(["compare", "--play", "hamlet", "--play-tokens", "60", "--method", "full", "--method",
                 "streaming_llm:window=0.25", "--method", "kivi:residual=0", "--max-new-tokens", "2", "--quiet",
                 "--block-size", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["block_size"] == 8
    full, window, kivi = (r["layout_bytes"] for r in data["results"])
    assert set(full) == {"counted", "dense_per_layer", "paged_shared", "paged_shared_compacted", "paged_per_head"}
    tokens = data["prompt_tokens"] + 1  # one generated token fed
    assert full["counted"] == data["results"][0]["kv_bytes"]
    assert full["paged_shared"] == full["counted"] * (-(-tokens // 8) * 8) // tokens
    token_bytes = full["counted"] // tokens  # one token in every layer and head
    assert window["counted"] <= window["paged_shared"] <= window["counted"] + 2 * 8 * token_bytes  # sinks, window
    assert kivi["counted"] == data["results"][2]["kv_bytes"] < full["counted"]


def test_a_block_of_no_slots_exits_2(capsys):
    assert main(["compare", "--play", "hamlet", "--block-size", "0"]) == 2
    assert "block size 0" in capsys.readouterr().err
