"""The ppl and needle commands: one-line errors, and numbers that agree with the model itself."""

import json
import math

import pytest
import torch

from kvviz import cli
from kvviz.cli import main
from kvviz.studies.perplexity import play_text


@pytest.mark.parametrize("argv, message", [
    (["ppl"], "exactly one of --text-file"),
    (["ppl", "--play", "nosuchplay"], "unknown play 'nosuchplay'"),
    (["ppl", "--text-file", "/nonexistent.txt"], "no such file"),
    (["ppl", "--play", "hamlet", "--tokens", "100", "--start", "99"], "--start"),
    (["ppl", "--play", "hamlet", "--method", "nosuch"], "unknown method"),
    (["needle", "--lengths", "512,abc"], "bad --lengths"),
    (["needle", "--depths", ""], "bad --depths"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_ppl_of_full_equals_the_models_own_loss(real_model, tmp_path, monkeypatch):
    monkeypatch.setattr(cli.options, "load", lambda args: real_model)  # the command as run, on the shared model
    out = tmp_path / "ppl.json"
    assert main(["ppl", "--play", "hamlet", "--tokens", "160", "--start", "0", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    result = data["results"][0]
    ids = real_model.tokenizer(play_text("hamlet"))["input_ids"][:160]
    with torch.inference_mode():
        loss = float(real_model.model(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    assert data["tokens"] == 160 and result["method"] == "full" and result["tokens"] == 159
    assert math.isclose(result["nll"], loss, rel_tol=1e-4) and math.isclose(result["ppl"], math.exp(loss), rel_tol=1e-4)


def test_needle_command_query_agnostic_end_to_end(real_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.options, "load", lambda args: real_model)
    out = tmp_path / "needle.json"
    code = main(["needle", "--lengths", "300", "--depths", "0.5", "--mode", "query_agnostic", "--json", str(out),
                 "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    cell = data["cells"][0]
    assert data["settings"]["mode"] == "query_agnostic" and cell["method"] == "full"
    assert cell["found"] and cell["survived"] and cell["key"] in cell["answer"]
    assert "1/1" in capsys.readouterr().out
