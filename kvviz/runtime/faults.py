"""Turning failures into messages a student can act on, and cleaning up after them."""

from __future__ import annotations

import torch

from kvviz.cache.spec import SpecError


class ModelError(ValueError):
    """A model that cannot be loaded, with a message meant for the user (raised by :mod:`kvviz.runtime.models`)."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release_accelerator_memory() -> None:
    """Return cached blocks to the device after a failure so the next run starts clean."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe_error(error: BaseException) -> str:
    """One or two sentences for the page: what went wrong and which setting to change."""
    if is_out_of_memory(error):
        release_accelerator_memory()
        return ("The device ran out of memory. Lower 'max new tokens', shorten the prompt or compare fewer methods; "
                "cached memory was released and the app keeps serving.")
    if isinstance(error, (SpecError, ModelError)):
        return str(error)
    text = str(error)
    if isinstance(error, OSError) and any(w in text.lower() for w in ("connect", "offline", "resolve", "network")):
        return "The model hub is unreachable from this server; choose a model that is already available locally."
    first_line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
