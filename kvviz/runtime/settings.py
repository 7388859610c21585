"""Deployment settings from the environment, read in one place and checked once.

Every environment variable kvviz or its container reads is declared once in :data:`VARIABLES` (name, default,
meaning, who reads it); :meth:`Settings.from_env` reads its own from there, and :func:`variables_markdown` renders
the table docs/deployment.md carries (tests/test_docs.py checks the two agree).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvviz.runtime.models import DEFAULT_MODEL

APP = "app"  # read through Settings.from_env: the app, and `python -m kvviz config`, which checks them


@dataclass(frozen=True)
class Variable:
    """One environment variable: what unset means (``default``, as a user would write it), why it exists and who
    reads it (:data:`VARIABLES` holds every one; the app's own are read by :meth:`Settings.from_env`)."""

    name: str
    default: str
    meaning: str
    read_by: str = APP
    shown: str = ""  # the default as the table shows it, where the raw text would not say it

    def read(self, environ: Mapping[str, str]) -> str:
        """The value ``environ`` sets, stripped; ``default`` when it is unset or blank."""
        return environ.get(self.name, "").strip() or self.default

    def table_default(self) -> str:
        return self.shown or (f"`{self.default}`" if self.default else "empty")


MODEL = Variable("KVVIZ_MODEL", DEFAULT_MODEL, "model preselected in the app; the CLI's `--model` default",
                 read_by=f"{APP}, CLI", shown=f"`{DEFAULT_MODEL}` (class mode: the first allowed)")
ALLOWED_MODELS = Variable("KVVIZ_ALLOWED_MODELS", "", "comma-separated models; set, it is class mode: users pick "
                          "only from this list (no typed hub ids)", shown="empty (free choice)")
MAX_PROMPT_TOKENS = Variable("KVVIZ_MAX_PROMPT_TOKENS", "4096", "longer prompts are refused (the app offers to cut "
                             "the middle)")
MAX_NEW_TOKENS = Variable("KVVIZ_MAX_NEW_TOKENS", "256", "cap on generated tokens per method")
DEVICE = Variable("KVVIZ_DEVICE", "auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps",
                  read_by=f"{APP}, CLI")
MAX_ITEMS = Variable("KVVIZ_MAX_ITEMS", "128", "most task items, or prompts of a prompt set, one Trade-offs sweep "
                     "scores (a larger request is refused, naming this limit)")
MAX_UPLOAD_MB = Variable("KVVIZ_MAX_UPLOAD_MB", "2", "largest prompt file accepted (the container passes it to "
                         "Streamlit's upload limit too)", read_by=f"{APP}, container entry point")
PRESSES = Variable("KVVIZ_PRESSES", "", "comma-separated dotted paths of your own kvpress presses "
                   "(`kvpress_native:press=...`)", read_by=f"{APP}, CLI")
RAY_ADDRESS = Variable("KVVIZ_RAY_ADDRESS", "", "a Ray cluster (`auto`, `ray://head:10001`) the Trade-offs page "
                       "sends its sweeps to, in shards on its workers, each stored as it finishes",
                       shown="empty (sweeps run in the server)")
ALLOW_PRESSES = Variable("KVVIZ_ALLOW_PRESSES", "0", "1: offer `KVVIZ_PRESSES` in class mode too")

VARIABLES: tuple[Variable, ...] = (
    MODEL, ALLOWED_MODELS, MAX_PROMPT_TOKENS, MAX_NEW_TOKENS, MAX_ITEMS, DEVICE, MAX_UPLOAD_MB, PRESSES, ALLOW_PRESSES,
    RAY_ADDRESS,
    Variable("KVVIZ_CACHE", "~/.cache/kvviz", "where converted models live (the image sets `/models/kvviz`, "
             "the models volume)", read_by="model loading"),
    Variable("KVVIZ_RESULTS", "", "the result store: finished runs on disk, keyed by inputs, model and kvviz's code",
             read_by="result store", shown="`$KVVIZ_CACHE/results`"),
    Variable("KVVIZ_WARM", "1", "the container warms the result store before serving (0: serve at once)",
             read_by="container entry point"),
    Variable("KVVIZ_ADDRESS", "0.0.0.0", "address the container's server listens on", read_by="container entry point"),
    Variable("PORT", "8501", "port the container's server listens on", read_by="container entry point"),
    Variable("KVVIZ_ENTRYPOINT_DRY_RUN", "0", "1: the entry point prints its commands instead of running them (tests)",
             read_by="container entry point"),
    Variable("KVVIZ_PORT", "8501", "host port `docker compose up` publishes", read_by="compose.yaml"),
    Variable("KVVIZ_REPLICAS", "3", "replicas behind the proxy (`--profile scaled`); each loads its own model",
             read_by="compose.yaml"),
    Variable("KVVIZ_TOKENIZER", "artifacts/tokenizer", "tokenizer folder the GPU check carries for the classroom "
             "section", read_by="scripts/gpu_check.sh"),
    Variable("HF_HUB_OFFLINE", "", "1: hub ids are looked up in the local Hugging Face cache only (the image sets 1)",
             read_by="model loading"),
    Variable("HF_ENDPOINT", "https://huggingface.co", "the hub a 3-second probe checks before a hub id downloads",
             read_by="model loading"),
)


def variables_markdown() -> str:
    """The one table of environment variables, as docs/deployment.md carries it."""
    rows = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.table_default()} | {v.read_by} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)


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
            allow_presses_in_class_mode=ALLOW_PRESSES.read(environ).lower() in ("1", "true", "yes"),
            ray_address=RAY_ADDRESS.read(environ),
        )
