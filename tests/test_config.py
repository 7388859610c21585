"""Settings from the environment and the messages failures turn into."""

import re
from pathlib import Path

import pytest
import torch

from kvviz.methods import SpecError
from kvviz.runtime.faults import describe_error
from kvviz.runtime.settings import APP, MAX_PROMPT_TOKENS, VARIABLES, Settings, SettingsError


def test_defaults_and_class_mode():
    default = Settings.from_env({})
    assert default.model == "smollm2-135m-instruct" and not default.class_mode
    assert default.max_prompt_tokens == 4096 and default.max_new_tokens == 256
    classroom = Settings.from_env({"KVVIZ_ALLOWED_MODELS": "smollm2-135m-instruct, Qwen/Qwen2.5-0.5B-Instruct",
                                   "KVVIZ_MAX_NEW_TOKENS": "64"})
    assert classroom.class_mode and classroom.models_offered == ["smollm2-135m-instruct", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert classroom.model_allowed("Qwen/Qwen2.5-0.5B-Instruct") and not classroom.model_allowed("evil/model")
    assert classroom.max_new_tokens == 64


@pytest.mark.parametrize("env, message", [
    ({"KVVIZ_MAX_PROMPT_TOKENS": "lots"}, "not a whole number"),
    ({"KVVIZ_MAX_NEW_TOKENS": "0"}, "must be positive"),
    ({"KVVIZ_ALLOWED_MODELS": "a/b", "KVVIZ_MODEL": "c/d"}, "not in KVVIZ_ALLOWED_MODELS"),
])
def test_bad_settings_are_named(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_errors_become_actionable_messages():
    assert "ran out of memory" in describe_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert describe_error(SpecError("unknown method 'x'; valid: full")) == "unknown method 'x'; valid: full"
    assert "unreachable" in describe_error(OSError("We couldn't connect to 'https://huggingface.co'"))
    assert describe_error(RuntimeError("bad\ntrace")) == "RuntimeError: bad"


READERS = ("kvviz", "kvviz_app", "views", "app.py", "docker", "Dockerfile", "compose.yaml", "scripts", "Makefile")


def _read_code() -> str:
    root = Path(__file__).resolve().parents[1]
    files = [p for name in READERS for p in ([root / name] if (root / name).is_file() else (root / name).rglob("*"))
             if p.is_file() and p.suffix in ("", ".py", ".sh", ".yaml") and p.name != "settings.py"]
    return "\n".join(p.read_text() for p in files)


def test_every_environment_variable_the_code_reads_is_declared_once():
    """The docs' one table is rendered from VARIABLES, so a variable read anywhere must be declared there."""
    code = _read_code()
    read = set(re.findall(r"\bKVVIZ_[A-Z_]+\b", code)) | set(re.findall(r"environ\.get\(\"([A-Z_]+)\"", code))
    declared = [v.name for v in VARIABLES]
    assert len(declared) == len(set(declared))
    assert read - set(declared) == set(), "declare these in kvviz/runtime/settings.py's VARIABLES"
    unread = [v.name for v in VARIABLES if v.read_by != APP and not re.search(rf"\b{v.name}\b", code)]
    assert unread == [], "declared but read nowhere outside Settings.from_env"


def test_settings_take_their_defaults_from_the_declarations():
    assert Settings.from_env({}) == Settings()
    assert Settings().max_prompt_tokens == int(MAX_PROMPT_TOKENS.default)
