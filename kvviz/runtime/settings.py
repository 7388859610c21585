"""Deployment settings from the environment, read in one place and checked once.

| variable                 | default                   | meaning                                                     |
|--------------------------|---------------------------|-------------------------------------------------------------|
| KVVIZ_MODEL              | smollm2-135m-instruct     | model preselected in the app and used by the CLI            |
| KVVIZ_ALLOWED_MODELS     | (empty: free choice)      | comma-separated list; class mode, users pick only from it   |
| KVVIZ_MAX_PROMPT_TOKENS  | 4096                      | longer prompts are refused (the app offers to truncate)     |
| KVVIZ_MAX_NEW_TOKENS     | 256                       | cap on generated tokens per method                          |
| KVVIZ_DEVICE             | auto                      | auto, cpu, cuda, cuda:N or mps                              |
| KVVIZ_MAX_UPLOAD_MB      | 2                         | largest prompt file accepted by the app                     |
| KVVIZ_PRESSES            | (empty)                   | comma-separated dotted paths of your own kvpress presses    |
| KVVIZ_ALLOW_PRESSES      | 0                         | 1: KVVIZ_PRESSES are offered in class mode too              |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvviz.runtime.models import DEFAULT_MODEL


class SettingsError(ValueError):
    """An environment variable with a value kvviz cannot use."""


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r} must be positive")
    return value


@dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL
    allowed_models: tuple[str, ...] = ()
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 256
    device: str = "auto"
    max_upload_mb: int = 2
    presses: tuple[str, ...] = ()  # dotted paths of the server's own kvpress presses (kvpress_native)
    allow_presses_in_class_mode: bool = False

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
        allowed = tuple(m.strip() for m in environ.get("KVVIZ_ALLOWED_MODELS", "").split(",") if m.strip())
        model = environ.get("KVVIZ_MODEL", "").strip() or (allowed[0] if allowed else DEFAULT_MODEL)
        if allowed and model not in allowed:
            raise SettingsError(f"KVVIZ_MODEL={model!r} is not in KVVIZ_ALLOWED_MODELS")
        return cls(
            model=model,
            allowed_models=allowed,
            max_prompt_tokens=_positive_int(environ, "KVVIZ_MAX_PROMPT_TOKENS", cls.max_prompt_tokens),
            max_new_tokens=_positive_int(environ, "KVVIZ_MAX_NEW_TOKENS", cls.max_new_tokens),
            device=environ.get("KVVIZ_DEVICE", "").strip() or "auto",
            max_upload_mb=_positive_int(environ, "KVVIZ_MAX_UPLOAD_MB", cls.max_upload_mb),
            presses=tuple(p.strip() for p in environ.get("KVVIZ_PRESSES", "").split(",") if p.strip()),
            allow_presses_in_class_mode=environ.get("KVVIZ_ALLOW_PRESSES", "").strip().lower() in ("1", "true", "yes"),
        )
