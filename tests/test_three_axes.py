"""One budget spent on heads, a latent, tokens or bits: the specs, the run on a needle prompt, the CLI table."""

import json

import pytest

from kvviz import cli
from kvviz.planning.memory import model_card
from kvviz.studies.three_axes import axes_specs, budget_specs, run_axes


def test_budget_specs_spend_a_third_on_each_axis_of_the_default_model(real_model):
    card = model_card(real_model)  # 3 KV heads of 64 dims, fp32 on the CPU
    assert budget_specs(card, 1 / 3) == {
        "heads": "merge_heads:kv_heads=1", "latent": "lowrank:rank=64", "tokens": "snapkv:budget=0.333333",
        "bits": "kivi:bits=8,residual=32",
    }
    half = budget_specs(card, 0.5)
    assert half["latent"] == "lowrank:rank=96" and half["tokens"] == "snapkv:budget=0.5"


def test_several_budgets_and_added_specs_make_one_list_each_spec_once(real_model):
    card = model_card(real_model)
    specs = axes_specs(card, [1 / 3, 0.5], ["lowrank:rank=128+kivi:bits=8,residual=32", "merge_heads:kv_heads=1"])
    assert len(specs) == 7 + 7 - 2 + 1  # merge_heads:kv_heads=1 and kivi:bits=8 are both budgets' (and --also's)
    assert specs[:7] == axes_specs(card, [1 / 3])
    assert "lowrank:rank=96+snapkv:budget=0.5" in specs and specs[-1] == "lowrank:rank=128+kivi:bits=8,residual=32"


def test_run_axes_reports_shares_factors_and_the_needle(tiny_model):
    rows, key = run_axes(tiny_model, ["merge_heads:kv_heads=1", "lowrank:rank=8+window:window=32"], length=128,
                         max_new_tokens=2)
    assert [r.method for r in rows] == ["full", "merge_heads", "lowrank:rank=8+window:window=32"]
    full, merged, stacked = rows
    assert full.share_of_full == 1 and full.agreement == 1 and len(key) == 5
    assert merged.share_of_full == pytest.approx(0.5) and merged.architecture == 0.5
    assert stacked.kv_bytes == 32 * 2 * (8 + 8) * 4  # 32 tokens x 2 layers x a latent of 8 + 8, fp32
    assert stacked.architecture == 0.25 and 0.2 < stacked.eviction < 0.3
    assert stacked.share_of_full == pytest.approx(stacked.architecture * stacked.eviction)
    assert all(isinstance(r.needle_found, bool) for r in rows)


def test_axes_command_prints_the_markdown_table(tiny_model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli.options, "load", lambda args: tiny_model)
    out = tmp_path / "axes.json"
    code = cli.main(["axes", "--method", "merge_heads:kv_heads=1", "--length", "96", "--max-new-tokens", "2",
                     "--quiet", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| SPEC | KV bytes | share of full |" in printed and "| `merge_heads` |" in printed
    assert "0.500 × 1.000 × 1.000" in printed
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["full", "merge_heads"]


@pytest.mark.parametrize("argv, message", [(["--budget", "1.5"], "bad --budget"),
                                           (["--method", "merge_heads+lowrank"], "two architecture methods"),
                                           (["--method", "full", "--also", "window"], "--also adds SPECs")])
def test_axes_command_mistakes_are_one_line(argv, message, capsys):
    assert cli.main(["axes", *argv]) == cli.USAGE_ERROR
    assert message in capsys.readouterr().err


def test_compare_offers_the_architecture_axis_and_lessons_has_the_three_axes_step():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    pages = Path(__file__).resolve().parents[1] / "views"
    app = AppTest.from_file(str(pages / "2_Compare.py"), default_timeout=300)
    app.query_params["m"] = ["full", "merge_heads:kv_heads=1+window:window=64", "lowrank:rank=64+kivi:bits=4"]
    app.run()
    assert not app.exception and not app.error
    assert app.selectbox(key="cfg0_architecture").options == ["none", "lowrank", "merge_heads"]
    assert (app.selectbox(key="cfg1_architecture").value, app.selectbox(key="cfg1_eviction").value) == (
        "merge_heads", "window")
    assert app.number_input(key="cfg2_lowrank_rank").value == 64
    lessons = AppTest.from_file(str(pages / "5_Lessons.py"), default_timeout=300)
    lessons.query_params["step"] = "6"
    lessons.run()
    assert not lessons.exception and lessons.radio(key="step").value == "6 · Three axes, one budget"
    assert any("`merge_heads:kv_heads=1`" in c.value and "`kivi:bits=8,residual=32`" in c.value
               for c in lessons.caption)
