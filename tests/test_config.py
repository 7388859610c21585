"""Settings from the environment and the messages failures turn into."""

import ast
import re
from pathlib import Path

import pytest
import torch
import yaml

from kvviz.methods import SpecError
from kvviz.runtime.faults import describe_error
from kvviz.runtime.settings import (
    APP,
    CLI,
    COMPOSE,
    ENTRY_POINT,
    GPU_CHECK,
    LOADING,
    MAKEFILE,
    MAX_PROMPT_TOKENS,
    STORE,
    VARIABLES,
    Settings,
    SettingsError,
)


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


ROOT = Path(__file__).resolve().parents[1]
PYTHON_SOURCES = ("kvviz", "kvviz_app", "views", "app.py")
SETTINGS = ROOT / "kvviz" / "runtime" / "settings.py"
SHELL_READERS = (ENTRY_POINT, COMPOSE, GPU_CHECK)  # readers that are files, named by their path


def environment_uses(source: str) -> list[str]:
    """Where ``source`` touches the process environment other than by a commented write (``os.environ[X] = ...``
    with its reason on that line or the one above: configuring Ray or a child process): one ``line: code`` each."""
    tree, lines = ast.parse(source), source.splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            uses = any(a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            uses = node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")
            parent = parents.get(node)
            if uses and isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
                uses = not any("#" in lines[n] for n in (node.lineno - 2, node.lineno - 1) if n >= 0)
        else:
            continue
        if uses:
            found.append((node.lineno, f"{node.lineno}: {lines[node.lineno - 1].strip()}"))
    return [use for _, use in sorted(found)]


def test_only_the_settings_module_reads_the_environment():
    files = [ROOT / name for name in PYTHON_SOURCES if (ROOT / name).is_file()]
    files += [p for name in PYTHON_SOURCES if (ROOT / name).is_dir() for p in (ROOT / name).rglob("*.py")]
    uses = {str(p.relative_to(ROOT)): environment_uses(p.read_text()) for p in files if p != SETTINGS}
    assert {path: found for path, found in uses.items() if found} == {}, \
        "read the environment through kvviz/runtime/settings.py (a Variable declared in VARIABLES)"


def test_the_environment_check_catches_reads_and_uncommented_writes():
    source = """import os
from os import environ
a = os.environ.get("A")
b = os.getenv("B")
c = {**os.environ}
os.environ["D"] = "0"
# Ray reads E when it is imported
os.environ["E"] = "0"
os.environ["F"] = "0"  # the child process reads F
"""
    assert [use.split(":")[0] for use in environment_uses(source)] == ["2", "3", "4", "5", "6"]


def shell_reads(text: str) -> dict[str, str | None]:
    """The variables a shell script or compose file takes from its environment, each with the default it gives
    (``${NAME:-default}``; None when it gives none): those with a default, and those it uses without setting."""
    assigned = set(re.findall(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=", text, flags=re.M))
    reads: dict[str, str | None] = {}
    for name, default in re.findall(r"\$\{([A-Za-z_]\w*):-([^}]*)\}", text):
        reads[name] = default
    for name in re.findall(r"\$\{?([A-Za-z_]\w*)", text):
        if name not in assigned:
            reads.setdefault(name, None)
    return reads


@pytest.mark.parametrize("reader", SHELL_READERS)
def test_every_variable_a_script_or_compose_reads_is_declared_with_its_default(reader):
    reads = shell_reads((ROOT / reader).read_text())
    declared = {v.name: v for v in VARIABLES if reader in v.read_by or (reader == COMPOSE and v.compose)}
    assert set(reads) == set(declared), "declare it in kvviz/runtime/settings.py's VARIABLES, naming this reader"
    if reader != GPU_CHECK:  # the GPU check runs the checkout's .venv, not the image's interpreter
        expected = {n: v.compose_default() if reader == COMPOSE and v.compose else v.default
                    for n, v in declared.items()}
        assert reads == expected, "a default given here differs from the declared one"


def test_the_makefile_reads_what_the_declarations_say():
    defaults = dict(re.findall(r"^(\w+) \?= (.*)$", (ROOT / MAKEFILE).read_text(), flags=re.M))
    assert set(defaults) == {v.name for v in VARIABLES if MAKEFILE in v.read_by}
    assert defaults["PORT"] == next(v.default for v in VARIABLES if v.name == "PORT")


def test_compose_passes_every_setting_and_nothing_else():
    environment = yaml.safe_load((ROOT / COMPOSE).read_text())["x-kvviz"]["environment"]
    assert list(environment) == [v.name for v in VARIABLES if v.compose]
    python_read = {v.name for v in VARIABLES if {APP, CLI, LOADING, STORE} & set(v.read_by)}
    assert python_read <= set(environment), "every variable kvviz's Python reads is a setting compose passes"


def test_a_class_mode_container_started_by_compose_has_valid_settings():
    """compose passes KVVIZ_MODEL empty unless set, so class mode's first allowed model is the default."""
    passed = {v.name: v.compose_default() for v in VARIABLES if v.compose}
    settings = Settings.from_env(passed | {"KVVIZ_ALLOWED_MODELS": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert settings.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert Settings.from_env(passed) == Settings()


def test_the_image_sets_what_the_declarations_say():
    text = (ROOT / "Dockerfile").read_text()
    blocks = "\n".join(block for block in re.split(r"\n(?=[A-Z]+ )", text) if block.startswith("ENV "))
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+?)\s*(?:\\|$)", blocks, flags=re.M))
    declared = {v.name for v in VARIABLES}
    assert {n: value for n, value in env.items() if n in declared} == {v.name: v.image for v in VARIABLES if v.image}


def test_the_docs_table_lists_every_declared_variable():
    table = (ROOT / "docs" / "deployment.md").read_text().split("<!-- generated: environment -->")[1]
    assert re.findall(r"^\| `(\w+)` \|", table.split("<!-- end generated")[0], flags=re.M) == [
        v.name for v in VARIABLES]


def test_settings_take_their_defaults_from_the_declarations():
    assert Settings.from_env({}) == Settings()
    assert Settings().max_prompt_tokens == int(MAX_PROMPT_TOKENS.default)
